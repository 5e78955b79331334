"""A pytest plugin writing each test's start and outcome to a file as they happen, so that a run
killed at its budget still names its failures and the tests it was running (gpu_check.sh's
tests step; its report reads the file when pytest was killed before writing --junitxml):

    PYTHONPATH=tools/benchmarks python -m pytest -p pytest_stream --stream-results FILE ...

One line per event, "<event> <node id>", written and flushed when it happens (what a killed
process wrote is already the OS's): started, then passed, failed, error (setup or teardown),
skipped, xfailed or xpassed; a failure's line ends with " | " and the first line of its error.
The first H200 run's verbose log lost its last lines (stdout to a file is block-buffered and a
killed process never flushes it), and with them the three failures near its end. Under
pytest-xdist only the controller writes: the workers' reports reach its hooks.
"""


class ResultStream:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: flushed per line

    def _write(self, event: str, nodeid: str, reason: str = "") -> None:
        reason = " ".join(reason.split())[:300]
        self.file.write(f"{event} {nodeid}" + (f" | {reason}" if reason else "") + "\n")

    def pytest_runtest_logstart(self, nodeid, location):
        self._write("started", nodeid)

    def pytest_runtest_logreport(self, report):
        xfail = hasattr(report, "wasxfail")
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            lines = (crash.message if crash is not None else str(report.longrepr)).strip().splitlines()
            self._write("failed" if report.when == "call" else "error", report.nodeid, lines[0] if lines else "")
        elif report.skipped and report.when != "teardown":
            self._write("xfailed" if xfail else "skipped", report.nodeid)
        elif report.when == "call":
            self._write("xpassed" if xfail else "passed", report.nodeid)

    def pytest_unconfigure(self, config):
        self.file.close()


def pytest_addoption(parser):
    parser.addoption("--stream-results", metavar="FILE", help="append each test's start and outcome to FILE")


def pytest_configure(config):
    path = config.getoption("--stream-results")
    if path and not hasattr(config, "workerinput"):  # an xdist worker: its controller writes
        config.pluginmanager.register(ResultStream(path), "stream-results")


FINISHED = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def read_results(path) -> dict:
    """{'outcomes': {node id: outcome}, 'reasons': {node id: reason}, 'running': [node ids started,
    never finished]} of a stream file. A test's last outcome wins (a teardown error after a pass)."""
    outcomes, reasons, started = {}, {}, []
    for line in open(path, encoding="utf-8", errors="replace"):
        event, _, rest = line.rstrip("\n").partition(" ")
        nodeid, _, reason = rest.partition(" | ")
        if event == "started":
            started.append(nodeid)
        elif event in FINISHED:
            if outcomes.get(nodeid) not in ("failed", "error"):
                outcomes[nodeid] = event
            if reason:
                reasons[nodeid] = reason
    running = [t for t in dict.fromkeys(started) if t not in outcomes]
    return {"outcomes": outcomes, "reasons": reasons, "running": running}


def killed_run_summary(path) -> str:
    """One line for gpu_check's report of a run killed before it wrote its --junitxml: the counts,
    every failure by name, and the tests it was running."""
    results = read_results(path)
    outcomes = results["outcomes"].values()
    count = {k: sum(v == k for v in outcomes) for k in ("passed", "failed", "error", "skipped", "xfailed")}
    failed = [t.split("/")[-1] for t, v in results["outcomes"].items() if v in ("failed", "error")]
    text = (f"killed before the end: {count['passed']} passed, {count['failed'] + count['error']} failed, "
            f"{count['skipped'] + count['xfailed']} skipped")
    text += ": " + ", ".join(failed) if failed else ""
    running = [t.split("/")[-1] for t in results["running"]]
    return text + (f"; running when killed: {', '.join(running)}" if running else "")
