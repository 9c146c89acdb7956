"""Run the installed `quantgate` CLI hundreds of times without paying for its start-up each time.

One server process imports quantgate.cli (and torch, onnx, onnxruntime, ...) once; for every command it forks a
child that runs `quantgate.cli.main` on that argv exactly as the console script does: the same click parsing,
signal handlers, error handling and exit codes, with stdout and stderr in files. The server waits for the child
under a timeout and reports how it ended: an exit code, or the signal that killed it (a native abort is SIGABRT
here, as it would be for a user), or a hang. Only the interpreter start-up and imports are shared.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVER = r"""
import json, os, signal, sys, time
import quantgate.cli as cli
import numpy, torch, onnx, onnxruntime, safetensors, tokenizers, gguf  # noqa: F401  (the imports worth sharing)
# the modules cli.py imports when a command runs (~1.4 s a command otherwise); none reads the environment when imported
import quantgate.train, quantgate.report, quantgate.quant.build, quantgate.quant.allocate  # noqa: F401,E401
import quantgate.quant.allocate_onnx, quantgate.quant.allocate_torch, quantgate.info, quantgate.generate  # noqa: F401,E401
import quantgate.evaluate, quantgate.demo, quantgate.attribution, quantgate.analyze  # noqa: F401,E401
import quantgate.export.onnx, quantgate.export.gguf  # noqa: F401,E401
out = sys.stdout
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(req["cwd"])
            os.environ.update(req["env"])
            for fd, name in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            code = 0
            try:
                cli.main(args=req["args"], prog_name="quantgate")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            code = 1
        os._exit(code)
    deadline, status = t0 + req["timeout"], None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        elif time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.01)
    res = {"seconds": time.time() - t0}
    if status == "timeout":
        res["timeout"] = True
    elif os.WIFSIGNALED(status):
        res["signal"] = os.WTERMSIG(status)
    else:
        res["code"] = os.WEXITSTATUS(status)
    out.write(json.dumps(res) + "\n")
    out.flush()
"""


@dataclass
class Result:
    args: list[str]
    code: int | None       # exit code, None when killed or hung
    signal: int | None     # the signal that killed it
    timeout: bool
    stdout: str
    stderr: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [ln for ln in self.stderr.strip().splitlines() if ln.strip()]


class CliServer:
    """`run(*args)` -> Result. Not thread-safe: one command at a time per server."""

    def __init__(self, env: dict | None = None):
        self.env = {"QUANTGATE_PROGRESS": "0", **(env or {})}
        self.dir = Path(tempfile.mkdtemp(prefix="qg-cli-server-"))
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=tempfile.gettempdir(),
                                     env={**os.environ, "QUANTGATE_PROGRESS": "0", "TOKENIZERS_PARALLELISM": "false"})
        self.n = 0

    def run(self, *args: str, timeout: float = 120, cwd: str | None = None, env: dict | None = None) -> Result:
        self.n += 1
        so, se = self.dir / f"{self.n}.out", self.dir / f"{self.n}.err"
        req = {"args": [str(a) for a in args], "cwd": cwd or tempfile.gettempdir(), "env": {**self.env, **(env or {})},
               "stdout": str(so), "stderr": str(se), "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the CLI server died")
        r = json.loads(line)
        res = Result(req["args"], r.get("code"), r.get("signal"), bool(r.get("timeout")),
                     so.read_text(errors="replace"), se.read_text(errors="replace"), r["seconds"])
        so.unlink()
        se.unlink()
        return res

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()
