"""A single-node Slurm cluster of our own, for the tests: munged, slurmctld and slurmd run as
children of the test process, in the foreground, with their own slurm.conf, state, spool and
log files and munge key in a temporary folder. Nothing of the machine's Slurm or munge set-up
(/etc/slurm, /etc/munge, system services) is read or touched.

The node declares more CPUs than the machine has (SlurmdParameters=config_overrides) so that
the job scripts' requests (four tasks, --exclusive, --cpus-per-task) are granted on a 2-core
machine; processes are tracked by their parent (proctrack/linuxproc) and not bound
(task/none), so no cgroup is needed. A requeued job waits cred_expire seconds before it may
start again (Slurm's default is 120): 5 here.
"""

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.distributed import free_port
from tests.slurm.watchdog import kill_all_with, processes_with

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}
CPUS = 64


def missing(path: str | None = None) -> str | None:
    """Why this machine cannot run the cluster, or None; `path`: where to look for the
    commands (PATH, /usr/sbin and /sbin by default)."""
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=path or _sbin_path()) is None]
    if absent:
        return (f"slurm-wlm/munge not installed ({', '.join(absent)} not found): "
                "apt-get install slurm-wlm munge (.ci/run does)")
    if os.geteuid() != 0:
        return f"slurmd must run as root to start jobs (this is uid {os.geteuid()})"
    return None


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _die_with_parent():
    """In the forked child: SIGKILL when the test process dies, even if no finalizer runs."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def clean_env(base: dict | None = None, **extra) -> dict:
    """`base` (the test's environment) without Slurm's own variables (an outer job's, or
    SBATCH_* defaults), pointed at this cluster by `extra`."""
    prefixes = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SCANCEL_")
    return {**{k: v for k, v in (base or os.environ).items() if not k.startswith(prefixes)}, **extra}


class SlurmCluster:
    def __init__(self):
        base = "/tmp" if os.path.isdir("/tmp") else None  # short paths: munge and slurmd put sockets here
        self.root = Path(tempfile.mkdtemp(prefix="megalite-slurm-", dir=base))
        self.root.chmod(0o755)  # munged refuses a socket whose folders others cannot search
        self.conf = self.root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]  # slurmctld runs only where SlurmctldHost names
        self.procs: dict[str, subprocess.Popen] = {}
        self.watchdog = subprocess.Popen(  # if this process dies before stop(): tests/slurm/watchdog.py
            [sys.executable, str(Path(__file__).with_name("watchdog.py")), str(self.root), str(self.conf)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=clean_env())

    # ---- start and stop -------------------------------------------------------------------
    def start(self, timeout: float = 60):
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        slurmctld_port, slurmd_port, training_port = _free_ports(3)
        # scripts/pretrain_gpt.sh trains on port 10000 + SLURM_JOB_ID % 50000: free for the first job
        self.conf.write_text(self._slurm_conf(slurmctld_port, slurmd_port, first_job=training_port + 40000))
        munge = self.root / "munge"
        self._spawn("munged", ["munged", "--foreground", f"--key-file={key}", f"--socket={munge / 'socket'}",
                               f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait(lambda: (munge / "socket").exists(), timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(lambda: self.node_state() in ("IDLE", "MIXED", "ALLOCATED"), timeout, "the node to be IDLE")

    def _slurm_conf(self, slurmctld_port: int, slurmd_port: int, first_job: int) -> str:
        r = self.root
        return f"""\
ClusterName=megalite
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={slurmctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/socket,cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/state/slurmctld.pid
SlurmdPidFile={r}/spool/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
FirstJobId={first_job}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, argv: list[str]):
        out = open(self.root / "log" / f"{name}.out", "wb")
        with out:
            self.procs[name] = subprocess.Popen(argv, env=clean_env(SLURM_CONF=str(self.conf), PATH=_sbin_path()),
                                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=_die_with_parent)

    def stop(self):
        """Cancel every job, end the daemons' process groups, then anything still running with
        this cluster's SLURM_CONF in its environment (slurmstepd and job processes leave the
        daemons' groups), and remove the folder."""
        try:
            if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
                self.cancel_all(timeout=45)
        finally:
            for name in reversed(DAEMONS):
                if name in self.procs:
                    _end_group(self.procs[name])
            kill_all_with(f"SLURM_CONF={self.conf}")
            shutil.rmtree(self.root, ignore_errors=True)
            self.watchdog.stdin.close()
            self.watchdog.wait(timeout=30)

    def stragglers(self) -> list[int]:
        """Live processes with this cluster's SLURM_CONF in their environment (the daemons,
        slurmstepd, the jobs' scripts and tasks)."""
        return processes_with(f"SLURM_CONF={self.conf}")

    # ---- clients --------------------------------------------------------------------------
    def env(self, base: dict | None = None, **extra) -> dict:
        """An environment for Slurm's client commands (and, through sbatch, the jobs)."""
        return clean_env(base, SLURM_CONF=str(self.conf), **extra)

    def command(self, argv: list[str], timeout: float = 30, check: bool = True, **kwargs) -> str:
        proc = subprocess.run(argv, env=kwargs.pop("env", None) or self.env(), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}\n{self.logs()}")
        return proc.stdout

    def sbatch(self, args: list[str], env: dict, cwd: Path) -> int:
        out = self.command(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        return int(out.strip().split(";")[0])

    def jobs(self, job_id: int) -> list[dict]:
        """`scontrol show job` of `job_id` (every task of an array), one dict per record."""
        out = self.command(["scontrol", "show", "job", "--oneliner", str(job_id)])
        return [dict(re.findall(r"(\w[\w/:]*)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def _check_daemons(self):
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with status {proc.returncode}\n{self.logs()}")

    def node_state(self) -> str | None:
        out = self.command(["scontrol", "show", "node", self.host], check=False, timeout=10)
        found = re.search(r"State=(\w+)", out)
        return found.group(1) if found else None

    def wait_for_jobs(self, job_id: int, condition, timeout: float, what: str, output: Path | None = None):
        """Poll `scontrol show job` until condition(records) holds; fail after `timeout` seconds
        with the records, the job's output and the daemons' logs."""
        records: list[dict] = []

        def check():
            nonlocal records
            records = self.jobs(job_id)
            return condition(records)

        self._wait(check, timeout, f"job {job_id}: {what}",
                   lambda: f"records: {records}\n{self.job_output(output)}")
        return records

    def wait_finished(self, job_id: int, timeout: float, output: Path | None = None) -> list[dict]:
        return self.wait_for_jobs(job_id, lambda rs: rs and all(r["JobState"] in TERMINAL for r in rs), timeout,
                                  "every task finished", output)

    def cancel_all(self, timeout: float = 45):
        """scancel every job (SIGTERM, then SIGKILL after KillWait) and wait for an empty queue."""
        self.command(["scancel", "--user", "root"], check=False)
        self._wait(lambda: not self.command(["squeue", "--noheader"], check=False).strip(), timeout,
                   "an empty queue after scancel")

    # ---- diagnostics ----------------------------------------------------------------------
    def job_output(self, path: Path | None) -> str:
        if path is None or not Path(path).exists():
            return f"(no job output at {path})"
        return f"--- job output {path} ---\n{Path(path).read_text(errors='replace')[-6000:]}"

    def logs(self) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def _wait(self, condition, timeout: float, what: str, details=lambda: ""):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_daemons()
            if condition():
                return
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{details()}\n{self.logs()}")


def _free_ports(count: int) -> list[int]:
    """`count` different free ports in 10000-59999 (where a job id can put the training port)."""
    ports: list[int] = []
    for _ in range(100 * count):
        port = free_port()
        if 10000 <= port < 60000 and port not in ports:
            ports.append(port)
            if len(ports) == count:
                return ports
    raise AssertionError(f"no {count} free ports in 10000-59999")


def _end_group(proc: subprocess.Popen, grace: float = 10):
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # anything left in its group
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
