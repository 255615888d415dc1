"""bench.decode_steps on the tiny model: a line per dtype and batch, with positive times."""

from __future__ import annotations

from bench import decode_steps


def test_prints_a_step_per_batch(capsys):
    argv = ["--model", "tiny", "--batches", "1,2", "--dtypes", "float32", "--rounds", "2"]
    assert decode_steps.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("float32", "1"), ("float32", "2")]
    assert all(float(r[2]) > 0 and float(r[5]) > 0 for r in rows)
    assert float(rows[1][4]) < float(rows[1][2])  # per sequence: the step over two
