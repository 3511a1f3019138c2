"""StateReader: whatever the piece size, the chunks of a prompt's pages and state rebuild the
payload exactly (stale rows of the last page zeroed), and the trailer's CRCs match the bytes."""

from __future__ import annotations

import threading

import pytest
import torch

from common.handoff.chunk_codec import decode_chunk
from common.handoff.checksum import crc32c
from common.handoff.manifest import FieldSpec
from common.engine.layer_progress import ForwardFailed, LayerProgress
from prefill_service.engine import StateReady
from common.handoff.ledger import fold_checksums, new_ledgers
from prefill_service.state_reader import ModelLayers, PromptShape, StateReader

LAYERS, POOL_PAGES, PAGE, HEADS, DIM, SLOTS = 3, 11, 4, 2, 8, 3


def pools(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, POOL_PAGES, 2, PAGE, HEADS, DIM, generator=g)
    conv = torch.randn(2, SLOTS, 6, 3, generator=g)
    ssm = torch.randn(2, SLOTS, 2, 4, 4, generator=g)
    draft = torch.randn(1, POOL_PAGES, 2, PAGE, HEADS, DIM, generator=g)
    return kv, conv, ssm, draft


def expected_paged(pool, page_ids, prompt_len):
    """[L, 2, n, page, ...] of the prompt's pages, rows past the prompt zeroed."""
    out = pool[:, torch.tensor(page_ids)].transpose(1, 2).contiguous()
    tail = len(page_ids) * PAGE - prompt_len
    if tail:
        out[:, :, -1, PAGE - tail:] = 0
    return out


FORWARD = ModelLayers((0, 2, 4), (1, 3))  # 3 attention and 2 GDN layers, interleaved


def layered_manifest(pages: int) -> dict[str, FieldSpec]:
    return {"kv": FieldSpec("float32", (3, 2, pages, PAGE, HEADS, DIM)),
            "conv_state": FieldSpec("float32", (2, 6, 3)),
            "ssm_state": FieldSpec("float32", (2, 2, 4, 4))}


def write_layer(i: int, kv, conv, ssm) -> None:
    """What model layer ``i`` of the "forward" writes: its own KV or GDN state."""
    if i in FORWARD.full_attention:
        kv[FORWARD.full_attention.index(i)] += 1
    else:
        j = FORWARD.gdn.index(i)
        conv[j] += 1
        ssm[j] += 1


def assert_rebuilt(messages, want: dict[str, torch.Tensor]) -> None:
    """The chunks in ``messages`` hold exactly ``want``'s bytes."""
    got = {name: torch.zeros_like(t) for name, t in want.items()}
    for message in messages:
        chunk = decode_chunk(message)
        flat = got[chunk.field][chunk.layer].reshape(-1).view(torch.uint8)
        flat[chunk.offset:chunk.offset + len(chunk.data)] = torch.frombuffer(
            bytearray(chunk.data), dtype=torch.uint8)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("piece_bytes,chunk_bytes", [(1, 7), (300, 64), (1 << 20, 1 << 20),
                                                     (2 * PAGE * HEADS * DIM * 4 * 2, 100)])
def test_pages_and_states_rebuild_the_payload(piece_bytes, chunk_bytes):
    kv, conv, ssm, draft = pools()
    prompt_len, page_ids, slot = 18, (7, 2, 9, 0, 5), 1  # 5 pages, 2 stale rows in the last
    reader = StateReader(kv, conv, ssm, draft, chunk_bytes, piece_bytes=piece_bytes,
                         model_layers=ModelLayers((1, 3, 5), (0, 2)))
    prompt = PromptShape(prompt_len, PAGE)
    want = {"kv": expected_paged(kv, page_ids, prompt_len),
            "dflash_context": expected_paged(draft, page_ids, prompt_len),
            "conv_state": conv[:, slot].clone(), "ssm_state": ssm[:, slot].clone()}
    manifest = {name: FieldSpec("float32", tuple(t.shape)) for name, t in want.items()}
    ledgers = new_ledgers(manifest)
    got = {name: torch.zeros_like(t) for name, t in want.items()}
    # as chunked prefill reports it: 2 pages, then the rest with the state
    partial = StateReady(page_ids, slot, 2, True)
    final = StateReady(page_ids, slot, 5, True, first_token=3)
    messages = []
    for name in ("kv", "dflash_context"):
        messages += reader.read(partial, [(name, 0, 2)], False, prompt, ledgers)
        messages += reader.read(final, [(name, 2, 5)], False, prompt, ledgers)
    messages += reader.read(final, [], True, prompt, ledgers)
    for message in messages:
        chunk = decode_chunk(message)
        assert len(chunk.data) <= chunk_bytes
        flat = got[chunk.field][chunk.layer].reshape(-1).view(torch.uint8)
        flat[chunk.offset:chunk.offset + len(chunk.data)] = torch.frombuffer(
            bytearray(chunk.data), dtype=torch.uint8)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    checksums = fold_checksums(manifest, ledgers)
    for name, t in want.items():
        assert checksums[name] == crc32c(t.contiguous()), name


def test_reading_nothing_new_yields_nothing():
    kv, conv, ssm, draft = pools()
    reader = StateReader(kv, conv, ssm, None, 64)
    ready = StateReady((1, 2), 0, 2, False)
    assert list(reader.read(ready, [("kv", 2, 2)], False, PromptShape(8, PAGE), {})) == []


def test_model_layers_map_fields_to_the_layers_that_write_them():
    layers = ModelLayers(full_attention=(3, 7), gdn=(0, 1, 2, 4, 5, 6))
    assert layers.model_layer("kv", 1) == 7
    assert layers.model_layer("ssm_state", 3) == 4
    assert layers.model_layer("conv_state", 0) == 0
    assert layers.model_layer("dflash_context", 0) is None


def test_bad_sizes_are_refused():
    kv, conv, ssm, _ = pools()
    with pytest.raises(ValueError):
        StateReader(kv, conv, ssm, None, 0)
    with pytest.raises(ValueError):
        StateReader(kv, conv, ssm, None, 8, piece_bytes=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_reads_wait_for_each_layer_and_reuse_pinned_buffers():
    """Each layer is written by a kernel queued after a long one; its read waits for that
    layer's event only, lands in the reader's pinned pool, and every byte is right."""
    kv, conv, ssm, draft = (t.cuda() for t in pools(1))
    prompt_len, page_ids, slot = 21, (3, 8, 1, 10, 6, 4), 2
    reader = StateReader(kv, conv, ssm, draft, 100, piece_bytes=1000, model_layers=FORWARD)
    progress = LayerProgress(5, cuda=True)
    for i in range(5):  # the "forward": layer i rewrites its own state, then records
        busy = torch.randn(2048, 2048, device="cuda")
        for _ in range(4):
            busy = busy @ busy / 2048
        write_layer(i, kv, conv, ssm)
        progress.layer_queued(i)
    progress.finish()
    ready = StateReady(page_ids, slot, 6, False, layer_ready=progress, states_final=True)
    pages = len(page_ids)
    ledgers = new_ledgers(layered_manifest(pages))
    # read while the "forward" still runs on the device: nothing here synchronizes it
    messages = list(reader.read(ready, [("kv", 0, pages)], True, PromptShape(prompt_len, PAGE),
                                ledgers))
    assert_rebuilt(messages, {"kv": expected_paged(kv.cpu(), page_ids, prompt_len),
                              "conv_state": conv[:, slot].cpu(), "ssm_state": ssm[:, slot].cpu()})
    assert reader.host_buffers.pinned and reader.host_buffers.num_buffers == 0
    reader.close()


def test_a_last_chunk_is_read_in_the_order_the_forward_writes_it():
    """KV layers of model layers 1, 3, 5 and GDN layers of 0 and 2: a final report reads each
    layer's pieces after the model layer that writes them, GDN state between the attention
    layers' KV, and the draft's context (written after the forward) last; the bytes still
    rebuild the payload."""
    kv, conv, ssm, draft = pools()
    reader = StateReader(kv, conv, ssm, draft, 1 << 20, piece_bytes=1 << 20,
                         model_layers=ModelLayers((1, 3, 5), (0, 2)))
    final = StateReady((7, 2, 9), 1, 3, True, first_token=3)
    prompt = PromptShape(12, PAGE)
    ledgers = new_ledgers({
        "kv": FieldSpec("float32", (LAYERS, 2, 3, PAGE, HEADS, DIM)),
        "dflash_context": FieldSpec("float32", (1, 2, 3, PAGE, HEADS, DIM)),
        "conv_state": FieldSpec("float32", tuple(conv[:, 1].shape)),
        "ssm_state": FieldSpec("float32", tuple(ssm[:, 1].shape))})
    order = []
    for message in reader.read(final, [("kv", 0, 3), ("dflash_context", 0, 3)], True, prompt,
                               ledgers):
        chunk = decode_chunk(message)
        if not order or order[-1] != (chunk.field, chunk.layer):
            order.append((chunk.field, chunk.layer))
    assert order == [("conv_state", 0), ("ssm_state", 0), ("kv", 0), ("conv_state", 1),
                     ("ssm_state", 1), ("kv", 1), ("kv", 2), ("dflash_context", 0)]


def test_a_report_made_before_the_forward_reads_each_layer_once_it_has_run():
    """The reader starts before the "forward" (on this thread) has written anything; each
    layer's bytes are read only after that layer is queued, so every byte is the new one."""
    kv, conv, ssm, _ = pools(1)
    prompt_len, page_ids, slot = 21, (3, 8, 1, 10, 6, 4), 2
    reader = StateReader(kv, conv, ssm, None, 100, piece_bytes=1000, model_layers=FORWARD)
    progress = LayerProgress(5, cuda=False)
    ready = StateReady(page_ids, slot, 6, False, layer_ready=progress, states_final=True)
    pages = len(page_ids)
    ledgers = new_ledgers(layered_manifest(pages))
    messages, first_read = [], threading.Event()

    def read():
        for message in reader.read(ready, [("kv", 0, pages)], True,
                                   PromptShape(prompt_len, PAGE), ledgers):
            first_read.set()
            messages.append(message)

    thread = threading.Thread(target=read)
    thread.start()
    for i in range(5):
        assert not first_read.wait(0.05) or i > 0  # nothing is read before layer 0 is queued
        write_layer(i, kv, conv, ssm)
        progress.layer_queued(i)
    progress.finish()
    thread.join(10)
    assert_rebuilt(messages, {"kv": expected_paged(kv, page_ids, prompt_len),
                              "conv_state": conv[:, slot], "ssm_state": ssm[:, slot]})


def test_a_forward_that_fails_ends_the_reads_waiting_on_it():
    kv, conv, ssm, _ = pools(1)
    reader = StateReader(kv, conv, ssm, None, 100, model_layers=FORWARD)
    progress = LayerProgress(5, cuda=False)
    ready = StateReady((3, 8, 1, 10, 6, 4), 2, 6, False, layer_ready=progress,
                       states_final=True)
    progress.layer_queued(0)
    progress.fail(RuntimeError("boom"))
    messages = reader.read(ready, [("kv", 0, 6)], True, PromptShape(21, PAGE),
                           new_ledgers(layered_manifest(6)))
    with pytest.raises(ForwardFailed, match="before layer 1"):
        list(messages)


def _frame_messages(frames) -> list[bytes]:
    messages = []
    for frame in frames:
        messages.append(b"".join(bytes(part) for part in frame.parts))
        frame.done()
    return messages


@pytest.mark.parametrize("piece_bytes", [1, 300, 1 << 20])
def test_frames_carry_the_same_bytes_and_checksums_as_the_encoded_chunks(piece_bytes):
    """``frames`` (the tcp transport) and ``read`` (the gRPC stream) give the same payload
    bytes in the same order, and the same trailer CRCs; a frame's payload is one whole run of
    a piece (no chunk_bytes split)."""
    kv, conv, ssm, draft = pools()
    prompt_len, page_ids, slot = 18, (7, 2, 9, 0, 5), 1
    prompt = PromptShape(prompt_len, PAGE)
    want = {"kv": expected_paged(kv, page_ids, prompt_len),
            "conv_state": conv[:, slot].clone(), "ssm_state": ssm[:, slot].clone()}
    manifest = {name: FieldSpec("float32", tuple(t.shape)) for name, t in want.items()}
    final = StateReady(page_ids, slot, 5, True, first_token=3)
    outputs = {}
    for how in ("read", "frames"):
        reader = StateReader(kv, conv, ssm, None, 64, piece_bytes=piece_bytes,
                             model_layers=ModelLayers((1, 3, 5), (0, 2)))
        ledgers = new_ledgers(manifest)
        made = getattr(reader, how)(final, [("kv", 0, 5)], True, prompt, ledgers)
        messages = list(made) if how == "read" else _frame_messages(made)
        assert_rebuilt(messages, want)
        outputs[how] = (messages, fold_checksums(manifest, ledgers))
    assert outputs["read"][1] == outputs["frames"][1]
    runs = [(c.field, c.layer) for c in map(decode_chunk, outputs["frames"][0])]
    chunks = [(c.field, c.layer) for c in map(decode_chunk, outputs["read"][0])]
    assert list(dict.fromkeys(runs)) == list(dict.fromkeys(chunks))  # the same order
    page_bytes = PAGE * HEADS * DIM * 4
    per_piece = max(1, piece_bytes // (2 * page_bytes))
    assert len(runs) == LAYERS * 2 * -(-5 // per_piece) + 2 * 2  # K and V runs; 2 states x 2


def test_a_frames_buffer_goes_back_after_its_last_frame():
    from prefill_service.state_reader import _Lease

    class Buffer:
        released = 0

        def release(self):
            self.released += 1

    buffer = Buffer()
    lease = _Lease(buffer)
    frames = [lease.hold() for _ in range(3)]
    lease.drop()  # the reader is past the batch
    frames[0]()
    frames[1]()
    assert buffer.released == 0
    frames[2]()
    assert buffer.released == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_frames_are_views_of_pinned_batches_given_back_once_written():
    kv, conv, ssm, _ = (t.cuda() for t in pools(2))
    prompt_len, page_ids, slot = 21, (3, 8, 1, 10, 6, 4), 2
    reader = StateReader(kv, conv, ssm, None, 100, piece_bytes=3000, model_layers=FORWARD)
    ready = StateReady(page_ids, slot, 6, True, first_token=1)
    frames = list(reader.frames(ready, [("kv", 0, 6)], True, PromptShape(prompt_len, PAGE),
                                new_ledgers(layered_manifest(6))))
    assert reader.host_buffers.num_buffers > 0  # the frames still hold their batches
    assert_rebuilt(_frame_messages(frames),
                   {"kv": expected_paged(kv.cpu(), page_ids, prompt_len),
                    "conv_state": conv[:, slot].cpu(), "ssm_state": ssm[:, slot].cpu()})
    assert reader.host_buffers.num_buffers == 0
    reader.close()
