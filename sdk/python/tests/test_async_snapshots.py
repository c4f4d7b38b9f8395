"""Snapshots, forks, reset, pause/resume with the async client."""

import asyncio
import uuid

import pytest

import moat
from moat import AsyncSandbox

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /opt/c.tmp; mv /opt/c.tmp /opt/counter; sleep 0.1; done"


async def _wait_counter(sbx, above: int, within: float = 30.0) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if await sbx.files.exists("/opt/counter"):
            v = int((await sbx.files.read("/opt/counter")).strip())
            if v > above:
                return v
        await asyncio.sleep(0.1)
    raise AssertionError(f"the counter did not get past {above} in {within} s")


def test_async_snapshot_fork_reset(daemon):
    tag = uuid.uuid4().hex

    async def main():
        made, snap = [], None
        src = await AsyncSandbox.create(timeout=600, metadata={"suite": tag})
        made.append(src)
        try:
            await src.files.write("/opt/s/a.txt", "base state")
            snap = await src.create_snapshot(name=f"sdk-a-{tag[:12]}", metadata={"suite": tag})
            assert snap.id.startswith("snap_") and snap.sandbox_id == src.id and snap.kind == "filesystem"
            assert await AsyncSandbox.get_snapshot(snap.name) == snap
            assert [s.id for s in await AsyncSandbox.list_snapshots(metadata={"suite": tag})] == [snap.id]

            forks = await AsyncSandbox.fork(snap.name, 3, timeout=600, metadata={"suite": tag})
            made += forks
            assert [f.info.metadata["moat.fork-index"] for f in forks] == ["0", "1", "2"]
            assert all(f.info.snapshot == snap.id for f in forks)
            assert await asyncio.gather(*(f.files.read("/opt/s/a.txt") for f in forks)) == ["base state"] * 3
            await asyncio.gather(*(f.files.write("/opt/s/a.txt", f"fork {i}") for i, f in enumerate(forks)))
            assert await asyncio.gather(*(f.files.read("/opt/s/a.txt") for f in forks)) == [
                "fork 0", "fork 1", "fork 2"]

            await forks[0].reset()  # back to the snapshot it was started from
            assert await forks[0].files.read("/opt/s/a.txt") == "base state"
            assert await forks[1].files.read("/opt/s/a.txt") == "fork 1"  # the others are untouched
            await src.reset()  # back to the clean template
            assert not await src.files.exists("/opt/s/a.txt")
            await src.reset(snap)
            assert await src.files.read("/opt/s/a.txt") == "base state"
            assert src.info.state == "running"

            one = await AsyncSandbox.create(snapshot=snap.id, on_timeout="pause", timeout=600)
            made.append(one)
            assert (one.info.snapshot, one.info.on_timeout) == (snap.id, "pause")
            assert await one.files.read("/opt/s/a.txt") == "base state"

            with pytest.raises(moat.InvalidArgumentError) as e:
                await AsyncSandbox.fork(snap, 0)
            assert e.value.field == "count"
            with pytest.raises(moat.UnavailableError) as e:
                await src.create_snapshot(kind="full")
            assert e.value.field == "kind" and "full-state snapshots" in e.value.message
        finally:
            for s in made:
                try:
                    await s.kill()
                finally:
                    await s.close()
            if snap is not None:
                assert await AsyncSandbox.delete_snapshot(snap) is True
        assert await AsyncSandbox.delete_snapshot(snap.id) is False
        with pytest.raises(moat.NotFoundError):
            await AsyncSandbox.get_snapshot(snap.id)

    asyncio.run(asyncio.wait_for(main(), 180))


def test_async_pause_resume_connect(daemon):
    async def main():
        async with await AsyncSandbox.create(timeout=600) as sbx:
            await sbx.commands.run(COUNTER, background=True)
            before = await _wait_counter(sbx, 3)
            await sbx.pause()
            assert sbx.info.state == "paused"
            with pytest.raises(moat.ConflictError):
                await sbx.commands.run("true")
            with pytest.raises(moat.ConflictError):
                await sbx.files.read("/opt/counter")
            assert await sbx.resume() is True
            assert sbx.info.state == "running"
            resumed = await _wait_counter(sbx, before - 1)
            assert resumed >= before
            assert await _wait_counter(sbx, resumed) > resumed  # the same process counts on

            await sbx.pause()
            again = await AsyncSandbox.connect(sbx.id)  # resumes it
            try:
                assert again.info.state == "running"
                assert (await again.commands.run("echo back")).stdout == "back\n"
                now = await _wait_counter(again, resumed)
                assert now > resumed
            finally:
                await again.close()
            assert (await sbx.get_info()).state == "running"

    asyncio.run(asyncio.wait_for(main(), 120))
