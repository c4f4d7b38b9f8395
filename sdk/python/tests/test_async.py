import asyncio
import hashlib
import io
import os

import pytest

import moat
from moat import AsyncSandbox


def test_async_create_run_files(daemon, tmp_path):
    async def main():
        async with await AsyncSandbox.create(metadata={"async": "yes"}) as sbx:
            assert await sbx.is_running()
            assert [s.sandbox_id for s in await AsyncSandbox.list(metadata={"async": "yes"})] == [sbx.id]
            seen = []
            r = await sbx.commands.run("echo a; echo b >&2", on_stdout=seen.append)
            assert (r.stdout, r.stderr, seen) == ("a\n", "b\n", ["a\n"])
            with pytest.raises(moat.CommandExitException) as e:
                await sbx.commands.run("exit 2")
            assert e.value.exit_code == 2
            h = await sbx.commands.run("cat", background=True, stdin=True, tag="acat")
            await h.send_stdin("async-in\n")
            await h.close_stdin()
            again = await sbx.commands.connect("acat")
            assert (await again.wait()).stdout == "async-in\n"
            assert (await h.wait()).stdout == "async-in\n"

            data = os.urandom(3 << 20)
            assert (await sbx.files.write("/tmp/a.bin", io.BytesIO(data))).size == len(data)
            assert await sbx.files.read("/tmp/a.bin", format="bytes") == data
            stream = await sbx.files.read("/tmp/a.bin", format="stream")
            assert hashlib.sha256(await stream.read()).digest() == hashlib.sha256(data).digest()
            await sbx.files.write("/tmp/t.txt", "text")
            assert await sbx.files.read("/tmp/t.txt") == "text"
            assert {e.name for e in await sbx.files.list("/tmp")} >= {"a.bin", "t.txt"}
            src = tmp_path / "up"
            (src / "d").mkdir(parents=True)
            (src / "d" / "f").write_text("f")
            await sbx.files.upload_dir(str(src), "/tmp/aup")
            await sbx.files.download_dir("/tmp/aup", str(tmp_path / "down"))
            assert (tmp_path / "down" / "d" / "f").read_text() == "f"

            pty = await sbx.pty.create(cols=90, rows=30)
            await pty.send_input("stty size; exit\n")
            buf = bytearray()
            async for chunk in pty:
                buf += chunk
            assert b"30 90" in buf and pty.exit.exit_code == 0
            with pytest.raises(moat.NotFoundError):
                await sbx.files.read("/nope")
            sid = sbx.id
        with pytest.raises(moat.NotFoundError):
            await AsyncSandbox.connect(sid)

    asyncio.run(asyncio.wait_for(main(), 90))
