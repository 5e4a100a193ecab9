"""`meshtron doctor --nccl-log FILE...`: read NCCL_DEBUG=INFO/WARN logs and flag what hurts.

Line format (NCCL's debug.cc): `HOST:PID:TID [CUDADEV] NCCL INFO|WARN MESSAGE`, possibly behind a
launcher prefix such as `[rank3]:` or `[default0]:`. Read here:

- versions: `NCCL version 2.21.5+cuda12.4` (with or without the host prefix), `cudaDriverVersion`;
- communicators: `comm 0x.. rank R nranks N cudaDev D ... commId 0x.. - Init START|COMPLETE`
  (members, hosts); the lines a thread prints before its `Init COMPLETE` (channels, rings,
  trees, graph patterns) belong to that communicator;
- connections: `Channel 00/0 : 3[3] -> 4[0] [send] via NET/Socket/0` (also the older `Ring 00 :
  3 -> 4 via ...`): transport P2P (NVLink when the graph search found `type NVL`), SHM, NET/IB
  (GPUDirect RDMA when `/GDRDMA`), NET/Socket, CollNet/NVLS;
- networks: `NET/IB : Using [0]mlx5_0:1/IB ...`, `Using network Socket`;
- rings (`Channel 00/02 :  0 1 2 3`) and trees (`Trees [0] 1/-1/-1->0->-1`);
- problems: every `NCCL WARN` line, and PyTorch's ProcessGroupNCCL watchdog timeouts
  (`Watchdog caught collective operation timeout: WorkNCCL(SeqNum=.., OpType=..)`).

Flags: mixed NCCL (or CUDA driver) versions; traffic inside a node over the network or shared
memory (P2P unavailable); TCP sockets where InfiniBand exists, or between nodes at all;
InfiniBand without GPUDirect RDMA; with `--tp N`, a tensor-parallel communicator (N ranks)
that crosses nodes or runs over sockets (it carries several collectives per layer); warnings
and timeouts.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from meshtron.argtypes import existing_file
from meshtron.errors import UserError

_PREFIX = re.compile(r"^(?:\[[^\]]*\]:?\s*)*")
_LINE = re.compile(r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
                   r"(?:(?P<src>\S+) )?NCCL (?P<level>INFO|WARN|ERROR|TRACE|ABORT) (?P<msg>.*)$")
_VERSION = re.compile(r"NCCL version (?P<v>[\w.+-]+)")
_DRIVER = re.compile(r"cudaDriverVersion (?P<v>\d+)")
_COMM = re.compile(r"comm (?P<ptr>0x[0-9a-f]+) rank (?P<rank>\d+) nranks (?P<n>\d+) cudaDev "
                   r"(?P<dev>\d+)(?:.*?busId (?P<bus>[0-9a-f]+))?(?:.*?commId (?P<id>0x[0-9a-f]+))?"
                   r" - Init (?P<phase>START|COMPLETE)")
_EDGE = re.compile(r"(?:Channel|Ring) (?P<ch>\d+)(?:/\d+)? : (?P<a>\d+)(?:\[[0-9a-f]+\])? -> "
                   r"(?P<b>\d+)(?:\[[0-9a-f]+\])?(?: \[(?P<dir>send|receive)\])? via (?P<via>.+)$")
_RING = re.compile(r"^Channel (?P<ch>\d+)/(?P<nch>\d+) :\s+(?P<order>[\d\s]+)$")
_TREE = re.compile(r"^Trees (?P<trees>.+)$")
_PATTERN = re.compile(r"Pattern \d+, crossNic \d+, nChannels (?P<n>\d+), .*?type (?P<intra>\w+)/"
                      r"(?P<inter>\w+)")
_NET_IB = re.compile(r"NET/IB : Using (?P<devs>.*?)(?: ;|$)")
_TIMEOUT = re.compile(r"\[Rank (?P<rank>\d+)\].*?Watchdog caught collective operation timeout: "
                      r"WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+)"
                      r".*?ran for (?P<ms>\d+) milliseconds")


@dataclass
class Comm:
    """One NCCL communicator (by commId, or by the first member's pointer without one)."""

    key: str
    nranks: int
    members: dict[int, dict[str, Any]] = field(default_factory=dict)
    transports: Counter = field(default_factory=Counter)
    edges: set = field(default_factory=set)
    rings: set = field(default_factory=set)
    trees: int = 0
    graph_intra: set = field(default_factory=set)

    @property
    def hosts(self) -> list[str]:
        return sorted({m["host"] for m in self.members.values()})

    def to_dict(self) -> dict[str, Any]:
        return {"comm_id": self.key, "nranks": self.nranks, "hosts": self.hosts,
                "transports": dict(self.transports), "ring_channels": len(self.rings),
                "tree_channels": self.trees, "members_seen": len(self.members)}


@dataclass
class NcclReport:
    files: list[str]
    processes: dict[str, dict[str, Any]]
    comms: list[Comm]
    flags: list[dict[str, str]]
    warnings: list[str]
    timeouts: list[dict[str, Any]]
    banners: tuple[str, ...] = ()
    """Versions of the bare banners (a merged log's name no process: counted 0 processes)."""

    def to_dict(self) -> dict[str, Any]:
        versions = Counter(p["version"] for p in self.processes.values() if p.get("version"))
        return {"files": self.files, "hosts": sorted({p["host"] for p in self.processes.values()}),
                "processes": len(self.processes),
                "versions": {**{b: 0 for b in sorted(self.banners)}, **dict(versions)},
                "communicators": [c.to_dict() for c in self.comms], "flags": self.flags,
                "warnings": self.warnings, "timeouts": self.timeouts}

    def errors(self) -> list[dict[str, str]]:
        """The error-severity flags (a warning alone is not a failure)."""
        return [f for f in self.flags if f["severity"] == "error"]

    def text(self) -> str:
        d = self.to_dict()
        bad = [f for f in self.flags if f["severity"] == "error"]
        head = (f"{len(bad)} problem(s) and {len(self.flags) - len(bad)} warning(s) in the NCCL "
                f"logs of {d['processes']} processes on {len(d['hosts'])} host(s)"
                if self.flags else f"no problem found in the NCCL logs of {d['processes']} "
                f"processes on {len(d['hosts'])} host(s)")
        lines = [head + ".", ""]
        for f in self.flags:
            lines.append(f"{f['severity'].upper()}: {f['text']}")
        lines.append("")
        lines.append("NCCL versions: " + (", ".join(f"{v} ({_processes(n)})"
                                                    for v, n in d["versions"].items())
                                          or "not in the logs"))
        for c in self.comms:
            t = ", ".join(f"{k} {v}" for k, v in sorted(c.transports.items())) or "no connections"
            lines.append(f"communicator {c.key}: {c.nranks} ranks on {', '.join(c.hosts)}; "
                         f"{t}; {len(c.rings)} ring channel(s), {c.trees} tree channel(s)")
        for w in self.warnings[:10]:
            lines.append(f"warn: {w}")
        return "\n".join(lines).rstrip()


def transport(via: str, intra: set[str]) -> str:
    """'P2P/IPC/read' -> 'NVLink' or 'P2P', 'NET/IB/0/GDRDMA' -> 'IB/GDRDMA', ..."""
    parts = via.split()[0].split("/")
    if parts[0] == "P2P":
        return "NVLink" if "NVL" in intra else "P2P"
    if parts[0] == "NET":
        kind = parts[1] if len(parts) > 1 else "?"
        if kind == "IB" and "GDRDMA" in via:
            return "IB/GDRDMA"
        return kind
    return parts[0]


def _processes(n: int) -> str:
    return "a banner naming no process" if n == 0 else f"{n} process{'es' if n != 1 else ''}"


class _Reader:
    def __init__(self):
        self.processes: dict[str, dict[str, Any]] = {}
        self.comms: dict[str, Comm] = {}
        self.pending: dict[tuple, list[str]] = defaultdict(list)
        self.warnings: list[str] = []
        self.timeouts: list[dict[str, Any]] = []
        self.ib_hosts: set[str] = set()
        self.file_banners: set[str] = set()
        """The bare banners of the file being read (NCCL_DEBUG=VERSION/WARN prints it without
        NCCL's prefix, once per process that initialises NCCL)."""
        self.file_processes: set[str] = set()
        """The processes the file being read has lines of."""
        self.banners: set[str] = set()
        """Every bare banner's version (a merged log's banners name no process)."""

    def line(self, raw: str) -> None:
        if t := _TIMEOUT.search(raw):  # PyTorch's watchdog, behind its own prefixes
            self.timeouts.append({"rank": int(t["rank"]), "seq": int(t["seq"]), "op": t["op"],
                                  "seconds": int(t["ms"]) / 1000})
            return
        text = _PREFIX.sub("", raw.rstrip("\n"))
        m = _LINE.match(text)
        if m is None:
            self._bare(text)
            return
        proc = self.processes.setdefault(f"{m['host']}:{m['pid']}",
                                         {"host": m["host"], "pid": int(m["pid"])})
        self.file_processes.add(f"{m['host']}:{m['pid']}")
        msg = m["msg"].strip()
        if m["level"] in ("WARN", "ERROR", "ABORT"):
            self.warnings.append(f"{m['host']}:{m['pid']} [{m['dev']}] {msg}")
            return
        if v := _VERSION.search(msg):
            proc["version"] = v["v"]
        elif v := _DRIVER.search(msg):
            proc["driver"] = v["v"]
        elif _NET_IB.search(msg):
            self.ib_hosts.add(m["host"])
        elif c := _COMM.search(msg):
            self._comm(c, m, proc)
        else:
            self.pending[(m["host"], m["pid"], m["tid"])].append(msg)

    def _bare(self, text: str) -> None:
        """Lines without NCCL's prefix: rank 0's version banner."""
        if text.startswith("NCCL version") and (v := _VERSION.search(text)):
            self.file_banners.add(v["v"])
            self.banners.add(v["v"])

    def end_file(self) -> None:
        """A file's bare banner is its own processes' version (one log per node: each node's
        NCCL); it was the last file's for every process, so two nodes of different NCCL
        versions read as one (audit s55)."""
        if len(self.file_banners) == 1:  # several (a merged log): whose is unknown
            for name in self.file_processes:
                self.processes[name].setdefault("version", next(iter(self.file_banners)))
        self.file_banners, self.file_processes = set(), set()

    def _comm(self, c, m, proc) -> None:
        key = c["id"] or c["ptr"]
        comm = self.comms.setdefault(key, Comm(key, int(c["n"])))
        comm.members[int(c["rank"])] = {"host": m["host"], "pid": int(m["pid"]),
                                        "dev": int(c["dev"])}
        thread = (m["host"], m["pid"], m["tid"])
        if c["phase"] == "START":
            self.pending.pop(thread, None)
            return
        self._attribute(comm, m["host"], self.pending.pop(thread, []))

    def _attribute(self, comm: Comm, host: str, lines: list[str]) -> None:
        for msg in lines:
            if p := _PATTERN.search(msg):
                comm.graph_intra.add(p["intra"])
        for msg in lines:
            if e := _EDGE.search(msg):
                kind = transport(e["via"], comm.graph_intra)
                comm.transports[kind] += 1
                comm.edges.add((int(e["a"]), int(e["b"]), kind))
            elif r := _RING.match(msg):
                comm.rings.add(int(r["ch"]))
            elif _TREE.match(msg):
                comm.trees = max(comm.trees, msg.count("["))

    def report(self, files: list[str], tp: int | None) -> NcclReport:
        comms = sorted(self.comms.values(), key=lambda c: (-c.nranks, c.key))
        return NcclReport(files, self.processes, comms, self._flags(comms, tp),
                          self.warnings, self.timeouts, tuple(sorted(self.banners)))

    # -- what hurts ----------------------------------------------------------------------------
    def _flags(self, comms: list[Comm], tp: int | None) -> list[dict[str, str]]:
        flags: list[dict[str, str]] = []

        def flag(severity: str, code: str, text: str) -> None:
            flags.append({"severity": severity, "code": code, "text": text})

        versions = defaultdict(list)
        for name, p in self.processes.items():
            versions[p.get("version")].append(name)
        versions.pop(None, None)
        for banner in self.banners - set(versions):  # a merged log's: no process known
            versions[banner].append("an unnamed process")
        if len(versions) > 1:
            desc = "; ".join(f"{v} on {', '.join(sorted(ps)[:4])}"
                             + (f" and {len(ps) - 4} more" if len(ps) > 4 else "")
                             for v, ps in sorted(versions.items()))
            flag("error", "mixed_versions", f"ranks run different NCCL versions ({desc}): "
                 "protocols and algorithms may not match; install one version everywhere")
        drivers = {p.get("driver") for p in self.processes.values()} - {None}
        if len(drivers) > 1:
            flag("warning", "mixed_drivers", f"CUDA driver versions differ: {sorted(drivers)}")
        for c in comms:
            self._comm_flags(c, tp, flag)
        if tp and tp > 1 and not any(c.nranks == tp for c in comms):
            # Said, not an error: the rest of the report stands (a WARN-level log has no
            # communicator lines at all), but "no problem found" must not read as checked.
            sizes = sorted({c.nranks for c in comms})
            flag("warning", "tp_unmatched", f"--tp={tp}: no communicator of {tp} ranks in the "
                 "logs (" + (f"sizes seen: {', '.join(map(str, sizes))}" if sizes else
                             "no communicator lines: NCCL_DEBUG=INFO prints them")
                 + "), so the tensor-parallel check matched nothing")
        if self.timeouts:
            t = self.timeouts[0]
            flag("error", "timeout", f"{len(self.timeouts)} collective timeout(s); first: rank "
                 f"{t['rank']} {t['op']} SeqNum={t['seq']} after {t['seconds']:.0f} s")
        if self.warnings:
            flag("error", "nccl_warn", f"{len(self.warnings)} NCCL WARN line(s); first: "
                 f"{self.warnings[0]}")
        return flags

    def _comm_flags(self, c: Comm, tp: int | None, flag) -> None:
        host_of = {r: m["host"] for r, m in c.members.items()}
        name = f"communicator {c.key} ({c.nranks} ranks)"
        same_host_net = {(a, b, k) for a, b, k in c.edges if k in ("IB", "IB/GDRDMA", "Socket")
                         and a in host_of and b in host_of and host_of[a] == host_of[b]}
        if same_host_net:
            a, b, k = sorted(same_host_net)[0]
            flag("error", "intra_node_network", f"{name}: ranks {a} and {b} on {host_of[a]} "
                 f"talk over the network ({k}) instead of NVLink/PCIe P2P (P2P disabled or "
                 "GPUs not visible to each other?)")
        if c.transports.get("SHM"):
            flag("warning", "intra_node_shm", f"{name}: {c.transports['SHM']} connection(s) "
                 "inside a node go through host shared memory, not GPU peer-to-peer")
        socket_hosts = set(c.hosts) & self.ib_hosts
        if c.transports.get("Socket"):
            why = ("although InfiniBand was found on " + ", ".join(sorted(socket_hosts))
                   if socket_hosts else "no InfiniBand/RoCE in use")
            flag("error", "socket_transport", f"{name}: {c.transports['Socket']} connection(s) "
                 f"over TCP sockets ({why}); check NCCL_IB_DISABLE / NCCL_NET / "
                 "NCCL_SOCKET_IFNAME")
        if c.transports.get("IB") and not c.transports.get("IB/GDRDMA"):
            flag("warning", "no_gdr", f"{name}: InfiniBand without GPUDirect RDMA (data is "
                 "staged through host memory; nvidia-peermem loaded?)")
        if tp and tp > 1 and c.nranks == tp:
            if len(c.hosts) > 1:
                flag("error", "tp_crosses_nodes", f"{name} is a tensor-parallel group that "
                     f"spans {len(c.hosts)} nodes ({', '.join(c.hosts)}): its several "
                     "collectives per layer then run at network speed; keep tp within a node")
            if c.transports.get("Socket"):
                flag("error", "tp_over_sockets", f"{name} is a tensor-parallel group running "
                     "over TCP sockets")


def analyze_files(paths: list[str], tp: int | None = None) -> NcclReport:
    """Read the logs (one per rank or node, or one merged) and report."""
    reader = _Reader()
    for path in paths:
        p = existing_file(path, "--nccl-log")
        with p.open(errors="replace") as f:
            for raw in f:
                reader.line(raw)
        reader.end_file()
    if not reader.processes and not reader.timeouts:
        raise UserError(f"--nccl-log={' '.join(repr(str(x)) for x in paths)}: no NCCL log "
                        "lines (run with NCCL_DEBUG=INFO)")
    return reader.report([str(p) for p in paths], tp)
