"""BlockTable: a request's KV block ids as an int64 array (what each step's
graph inputs copy rows from), with the list-like reads the scheduler uses."""

from __future__ import annotations

import numpy as np

from pipeline.engine.block_table import BlockTable


def test_extend_grows_and_keeps_order():
    table = BlockTable()
    expected: list[int] = []
    for start in range(0, 400, 7):      # past the initial capacity, several times
        ids = list(range(start, start + 7))
        table.extend(ids)
        expected += ids
    assert table.tolist() == expected and len(table) == len(expected)
    assert table.view().dtype == np.int64 and table.view().tolist() == expected
    assert list(table) == expected and table == expected and table == BlockTable(expected)


def test_views_are_snapshots():
    table = BlockTable([3, 1, 4])
    before = table.view()
    table.extend(list(range(100)))     # grows into a new array
    assert before.tolist() == [3, 1, 4]
    kept = table.view()
    table.clear()
    assert len(table) == 0 and not table and table == []
    table.extend([9])                  # after clear(), a fresh array: old views keep their ids
    assert kept.tolist()[:3] == [3, 1, 4] and len(kept) == 103
    assert table.tolist() == [9]


def test_rows_copy_into_a_step_table():
    tables = [BlockTable(list(range(i * 10, i * 10 + n))) for i, n in enumerate((3, 5, 1))]
    host = np.full((3, 5), -1, dtype=np.int64)
    for row, table in zip(host, tables):
        used = table.view()[:5]
        row[:len(used)] = used
    assert host.tolist() == [[0, 1, 2, -1, -1], [10, 11, 12, 13, 14], [20, -1, -1, -1, -1]]
