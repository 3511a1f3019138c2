"""benchmarks/profile_step.py on the CPU with the built-in trained pair (a checkpoint and its
draft, the path a user's own pair takes): both steps timed, every DFLASH phase in the JSON."""

from __future__ import annotations

import json

from benchmarks.decode import fill_batch
from benchmarks.profile_step import PHASES, main, time_dflash_phases, tiny_engine


def test_a_checkpoint_and_its_draft_get_both_steps_profiled(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["--device", "cpu", "--model", "pycoder", "--draft", "pycoder",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "pycoder"
    # unprofiled steps: the wall time is a step's, not the profiler's start-up
    assert 0 < result["decode"]["wall_ms"] < result["dflash"]["step"] * 4
    assert set(PHASES) <= set(result["dflash"])
    assert result["dflash"]["propose"] > 0 and result["dflash"]["commit"] > 0
    # on the CPU the verify is the target's eager forward: timed, not left in "rest"
    assert result["dflash"]["verify"] > 0 and result["dflash"]["rest"] > 0
    assert "dflash step, medians (ms)" in capsys.readouterr().out
    # the host table is the DFLASH step's (the GDN walk of the CPU set's verify and commit,
    # which the workers take by default, is among its costliest functions; a trained draft
    # ends its requests early, so these steps must have work in them), most time of their
    # own first
    host = result["host_functions"]
    assert any(h["function"].startswith("replay_cpu.py") for h in host)
    own = [h["own_us_per_step"] for h in host]
    assert own == sorted(own, reverse=True) and all(
        h["cum_us_per_step"] >= h["own_us_per_step"] > 0 for h in host)


def test_a_checkpoint_without_a_draft_profiles_the_decode_step_only(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["--device", "cpu", "--model", "pycoder", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decode"]["wall_ms"] > 0 and result["dflash"] == {}
    assert result["host_functions"] and not any(
        h["function"].startswith(("draft_cpu.py", "draft_reference.py", "replay_cpu.py"))
        for h in result["host_functions"])


def test_a_phase_inside_another_counts_once():
    """``tiny``'s verify "graph" is uncaptured, so its run calls the target's forward, also a
    timed phase: counted in both, the phases added up to more than the step (a step's rest,
    what no phase timed, came out negative)."""
    engine = tiny_engine(draft=True)
    fill_batch(engine, 1, 24, 200, vocab=250)
    phases = time_dflash_phases(engine, "cpu", steps=6, warm=1)
    assert phases["verify"] > 0 and phases["rest"] >= 0
