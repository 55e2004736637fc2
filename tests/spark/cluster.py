"""A private Spark standalone cluster on 127.0.0.1: one master, N workers, from the pyspark package.

Every daemon is a JVM started with ``spark-class`` in the foreground (so its pid is ours to
stop), on free ports, with its logs, work and scratch directories under one temporary
directory. A port picked free may be taken before the master binds it (another run of the
suite beside this one): Spark then binds the next one, so the master's ports are read from
its own log, and the status page counts only when it names this master's URL. The
workers get one core and 512 MB each: executors are small, the machine is shared.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.request
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.support import wait_until

START_TIMEOUT = 240.0  # JVM start-ups on a loaded two-core machine
# The master's own report of the ports it bound (Spark's Utils.startServiceOnPort).
_BOUND = re.compile(rb"Successfully started service '(sparkMaster|MasterUI)' on port (\d{1,5})\b")
_LOG_HEAD = 1 << 20  # the lines sought come within the first second of the log


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclass
class Cluster:
    root: Path
    workers: int = 2
    port: int = field(default_factory=free_port)
    ui_port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def worker_dir(self, n: int) -> Path:
        return self.root / f"worker-{n}"

    def _env(self) -> dict[str, str]:
        conf = self.root / "conf"  # empty: no spark-defaults or log4j file of the machine leaks in
        conf.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_CONF_DIR": str(conf),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_DIRS": str(self.root / "local"),
            "SPARK_LOG_DIR": str(self.root / "logs"),
            "SPARK_DAEMON_MEMORY": "256m",
            # The REST submission server listens on a fixed port (6066): two clusters would collide.
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        }

    def _start(self, name: str, *args: str, env: dict[str, str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed by stop()
        self.logs.append(log)
        self.procs.append(
            subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )

    def start(self) -> None:
        env = self._env()
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port)),
            env=env,
        )
        bound: dict[bytes, int] = {}

        def master_bound() -> bool:
            self._check_alive()
            with open(self.root / "master.log", "rb") as log:
                bound.update((m.group(1), int(m.group(2))) for m in _BOUND.finditer(log.read(_LOG_HEAD)))
            return len(bound) == 2

        wait_until(master_bound, timeout=START_TIMEOUT, interval=0.2, message=f"the master's ports ({self.root})")
        self.port, self.ui_port = bound[b"sparkMaster"], bound[b"MasterUI"]
        for n in range(self.workers):
            self.worker_dir(n).mkdir(parents=True)
            self._start(
                f"worker-{n}",
                "org.apache.spark.deploy.worker.Worker",
                self.master_url,
                *("--host", "127.0.0.1", "--webui-port", str(free_port()), "--cores", "1", "--memory", "512m"),
                *("--work-dir", str(self.worker_dir(n))),
                env={**env, "SPARK_WORKER_DIR": str(self.worker_dir(n))},
            )
        wait_until(
            lambda: self._check_alive() and self.state().get("aliveworkers") == self.workers,
            timeout=START_TIMEOUT,
            interval=0.2,
            message=f"a master with {self.workers} alive workers (logs in {self.root})",
        )

    def _check_alive(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"a Spark daemon exited with {proc.returncode}: see the logs in {self.root}")
        return True

    def state(self) -> dict[str, object]:
        """This master's status page as JSON ({} while it is not up, or when what answers on
        its UI port is not this master: the page names the master's URL)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as resp:
                data = json.load(resp)
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("url") == self.master_url else {}

    def executor_logs(self, n: int) -> list[Path]:
        """stderr of every executor worker ``n`` ran (work dir: app id / executor id / stderr)."""
        return sorted(self.worker_dir(n).glob("app-*/*/stderr"))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for log in self.logs:
            log.close()
