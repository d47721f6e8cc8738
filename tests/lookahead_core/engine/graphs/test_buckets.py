"""Which ready graph runs a step, and the cells a graph is timed at."""
from lookahead_core.engine.graphs.buckets import TIMED_ROWS, Bucket, cheapest


def test_a_dynamic_graph_holds_every_shape_up_to_its_own():
    decode, prefill = Bucket(16, 64, 1087), Bucket(1, 128, 1087, prefill=True)
    ready = {decode, prefill}
    assert cheapest(ready, 1, 1, 20) == cheapest(ready, 16, 64, 1087) == decode
    assert cheapest(ready, 17, 1, 20) is None and cheapest(ready, 1, 65, 20) is None
    assert cheapest(ready, 1, 100, 300, prefill=True) == prefill and cheapest(ready, 1, 129, 300, prefill=True) is None
    assert decode.run_shape(3, 5) == (3, 5)


def test_static_graphs_pad_to_their_shape_and_the_fewest_padded_rows_win():
    ready = {Bucket(1, 1, 64, dynamic=False), Bucket(4, 1, 64, dynamic=False), Bucket(2, 4, 64, dynamic=False)}
    picks = {(1, 1): Bucket(1, 1, 64, dynamic=False), (3, 1): Bucket(4, 1, 64, dynamic=False),
             (1, 3): Bucket(2, 4, 64, dynamic=False), (2, 1): Bucket(4, 1, 64, dynamic=False), (3, 2): None}
    for (rows, width), bucket in picks.items():
        assert cheapest(ready, rows, width, 40) == bucket, (rows, width)
    assert Bucket(4, 1, 64, dynamic=False).run_shape(3, 1) == (4, 1)


def test_a_graph_is_timed_at_powers_of_two_of_its_batch_by_the_widths_it_holds():
    cells = Bucket(16, 64, 1087).timed_cells()
    assert (1, 1) in cells and (1, 32) in cells and (16, 1) in cells and (16, 16) in cells
    assert (16, 24) not in cells and all(b * w <= TIMED_ROWS for b, w in cells)
    assert {b for b, _ in cells} == {1, 2, 4, 8, 16}
    assert Bucket(3, 4, 63).timed_cells() == [(b, w) for b in (1, 2, 3) for w in (1, 2, 3, 4)]
    assert Bucket(4, 1, 64, dynamic=False).timed_cells() == [(4, 1)]
