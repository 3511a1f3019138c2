from router.policy import WorkerView, choose_decode, choose_pair, choose_prefill


def p(addr, queue=0, in_flight=0, healthy=True, fp="m"):
    return WorkerView(addr, "prefill", healthy, fp, queue_len=queue, in_flight=in_flight)


def d(addr, slots=4, pages=100, in_flight=0, healthy=True, fp="m"):
    return WorkerView(addr, "decode", healthy, fp, free_slots=slots, free_pages=pages,
                      in_flight=in_flight)


def test_prefill_shortest_queue_counts_router_in_flight():
    workers = [p("a", queue=2), p("b", queue=0, in_flight=3), p("c", queue=1)]
    assert choose_prefill(workers).address == "c"


def test_prefill_skips_unhealthy_excluded_and_decode():
    workers = [p("a", healthy=False), p("b", queue=5), p("c", queue=0), d("d")]
    assert choose_prefill(workers, exclude={"c"}).address == "b"
    assert choose_prefill([p("a", healthy=False), d("d")]) is None


def test_prefill_ties_round_robin_in_address_order():
    workers = [p("b"), p("a"), p("c", queue=1)]
    assert [choose_prefill(workers, turn=t).address for t in range(4)] == ["a", "b", "a", "b"]


def test_decode_most_free_slots_then_pages():
    workers = [d("a", slots=2, pages=500), d("b", slots=3, pages=10), d("c", slots=3, pages=20)]
    assert choose_decode(workers).address == "c"


def test_decode_discounted_by_in_flight_assignments():
    workers = [d("a", slots=4, in_flight=2), d("b", slots=3)]
    assert choose_decode(workers).address == "b"


def test_decode_full_worker_still_chosen_when_it_is_the_only_one():
    assert choose_decode([d("a", slots=0, pages=0)]).address == "a"
    assert choose_decode([d("a")], exclude={"a"}) is None


def test_decode_fingerprint_must_match():
    workers = [d("a", slots=9, fp="other"), d("b", slots=1, fp="m"), d("c", slots=2, fp="")]
    assert choose_decode(workers, fingerprint="m").address == "c"  # "" = not reported yet
    assert choose_decode(workers[:2], fingerprint="m").address == "b"


def test_pair_falls_back_to_prefill_with_a_compatible_decode():
    workers = [p("p1", queue=0, fp="x"), p("p2", queue=3, fp="m"), d("d1", fp="m")]
    pair = choose_pair(workers)
    assert (pair[0].address, pair[1].address) == ("p2", "d1")
    assert choose_pair(workers, exclude={"d1"}) is None
