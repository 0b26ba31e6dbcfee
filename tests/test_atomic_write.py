"""``paths.atomic_write``: two processes writing one file at once, with a third reading it all the
while, never leave or show a partial file, and never leave a temporary behind."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from trace_assets import paths

SIZE = 1 << 20  # 1 MiB: many write() calls' worth, so a torn file would show
ROUNDS = 40


def _payload(tag: bytes, i: int) -> bytes:
    head = tag + b"%06d" % i
    return head + tag * (SIZE - len(head))


def _whole(data: bytes) -> bool:
    """One writer's payload, complete: the right size, and one tag from the first byte to the last."""
    return len(data) == SIZE and data[:1] in (b"a", b"b") and data[7:] == data[:1] * (SIZE - 7)


def _writer(path: str, tag: bytes, start: mp.Barrier) -> None:
    start.wait()
    for i in range(ROUNDS):
        paths.atomic_write(Path(path), _payload(tag, i))


def _reader(path: str, stop: mp.Event, bad: mp.Queue, start: mp.Barrier) -> None:
    start.wait()
    reads = 0
    while not stop.is_set():
        data = Path(path).read_bytes()
        reads += 1
        if not _whole(data):
            bad.put(f"read {reads}: {len(data)} bytes, starting {data[:8]!r}")
            return
    bad.put(None)


def test_two_writers_at_once_never_leave_or_show_a_partial_file(tmp_path):
    target = tmp_path / "manifest.json"
    paths.atomic_write(target, _payload(b"a", 0))
    ctx = mp.get_context("fork")
    start, stop, bad = ctx.Barrier(3), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(str(target), tag, start)) for tag in (b"a", b"b")]
    reader = ctx.Process(target=_reader, args=(str(target), stop, bad, start))
    for p in (*writers, reader):
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0, "a writer failed (a shared temporary renamed away under it?)"
    stop.set()
    reader.join(60)
    assert bad.get(timeout=10) is None
    assert _whole(target.read_bytes())
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary left behind


def test_the_check_sees_a_torn_file_and_a_failed_write_keeps_the_old_one(tmp_path):
    """The test above could fail: its check rejects a truncated or mixed file. And a writer that
    dies half-way leaves the previous file whole and removes its temporary."""
    assert _whole(_payload(b"a", 3))
    assert not _whole(_payload(b"a", 3)[: SIZE // 2])
    assert not _whole(_payload(b"a", 3)[: SIZE // 2] + _payload(b"b", 3)[SIZE // 2:])
    target = tmp_path / "state.json"
    paths.atomic_write(target, "old")
    with pytest.raises(RuntimeError):
        with paths.atomic_path(target) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_atomic_folder_swaps_a_whole_folder_in_or_nothing(tmp_path):
    final = tmp_path / "adapter"
    with paths.atomic_folder(final) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(RuntimeError):
        with paths.atomic_folder(final) as tmp:
            (tmp / "weights").write_text("v2, half")
            raise RuntimeError("killed")
    assert (final / "weights").read_text() == "v1"
    with paths.atomic_folder(final) as tmp:
        (tmp / "weights").write_text("v2")
    assert (final / "weights").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]
