"""The report's Markdown blocks, each made from the pooled cells (:mod:`lab.report.cells`).

Every figure states how many units it pools, its median and range, and an interval only with
its degrees of freedom (:mod:`lab.report.stats`); every table names the model as it was: a
seeded model of hidden size 256 given a real model's layers and KV cache, whose prefill compute
is a tiny model's (:func:`model`).  The README's block names no run and no commit: it says how
many runs a figure pools and whether the code has changed since, and links to this detail.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lab.gpu.pd import GEOMETRIES, SCENARIOS
from lab.report import bench, cells, full_width, kv_bench, records, repeated
from lab.report.cells import PairCell, StartCell, ordered_prompts
from lab.report.epochs import CHANGES, KEPT, STOCK_FROM, Change
from lab.report.records import ROOT, Records, run_order
from lab.report.stats import Interval, Spread, geo, num, spread, ttft

TINY = json.loads((ROOT / "lab" / "rig" / "tiny_llama" / "config.json").read_text())
NAMED = {"llama3-8b": ("Llama-3-8B's KV", "Llama-3-8B's"),
         "qwen2.5-7b": ("Qwen2.5-7B's KV", "Qwen2.5-7B's"),
         "llama3-70b": ("Llama-3-70B's KV", "Llama-3-70B's"),
         "llama3-70b-tp2": ("Llama-3-70B's KV, one TP-2 rank's share",
                            "one TP-2 rank's share of Llama-3-70B's"),
         "deepseek-v2-lite": ("DeepSeek-V2-Lite's KV", "DeepSeek-V2-Lite's"),
         **full_width.NAMED}
"""Per ``--geometry``: the tables' short name, and whose layers and KV cache the model had."""


def model(geometry: str) -> str:
    """The model as it was: the rig's tiny seeded Llama, or a seeded model of the rig's hidden
    size given a real model's layers and KV cache (``lab.gpu.pd.GEOMETRIES``); a full-width
    model as :mod:`lab.report.full_width` names it."""
    if geometry in full_width.NAMED:
        return full_width.model(geometry)
    cfg = {**TINY, **GEOMETRIES[geometry]}
    if "kv_lora_rank" in cfg:
        kv = f"{cfg['num_hidden_layers']} layers of a {cfg['kv_lora_rank']} + " \
             f"{cfg['qk_rope_head_dim']} MLA latent"
    else:
        kv = f"{cfg['num_hidden_layers']} layers, {cfg['num_key_value_heads']} KV heads of " \
             f"{cfg['head_dim']}"
    if geometry == "tiny":
        return f"the rig's tiny seeded Llama (hidden size {cfg['hidden_size']}, {kv})"
    return f"a seeded model of hidden size {cfg['hidden_size']} with {NAMED[geometry][1]} " \
           f"layers and KV cache ({kv})"


def kv_of(geometry: str) -> str:
    """A table's short name for the model: whose KV cache it had."""
    return "tiny Llama" if geometry == "tiny" else NAMED[geometry][0]


def setting(name: str) -> str:
    """What a scenario ran, from its declaration (``lab.gpu.pd.SCENARIOS``)."""
    sc = SCENARIOS[name]
    if not sc.pdpatch:
        return "stock"
    parts = ["kvcached D" if sc.d_kvcached else ""]
    env = sc.d_env
    if env.get("PDPATCH_KV_COALESCE") == "1":
        parts.append("coalesced READs")
    if "PDPATCH_KV_STAGING_MIB" in env:
        mib = int(env["PDPATCH_KV_STAGING_MIB"])
        parts.append(f"{mib} MiB staging" if mib else "staging off")
    if env.get("PDPATCH_LAYOUT_FORCE") == "1":
        parts.append("D token-major (forced)")
    if sc.d_ktc.get("enable_permute_local_kv"):
        parts.append("operator's enable_permute_local_kv")
    if sc.p_backend != sc.d_backend:
        parts.append("mixed backends")
    if sc.hashseed is None:
        parts.append("PYTHONHASHSEED unset")
    if sc.kill_p:
        parts.append("P killed")
    return ", ".join(p for p in parts if p) or "defaults"


def pair_of(backends: tuple[str, str], tp: tuple[int, int]) -> str:
    p, d = backends
    side = {"FLASH_ATTN": "FA", "TRITON_ATTN": "Triton"}
    return f"{side.get(p, p)} TP {tp[0]} -> {side.get(d, d)} TP {tp[1]}"


def since(epoch: tuple[Change, ...]) -> str:
    """Where a cell's epoch began: the first run on it and the change(s) it measured."""
    return ", ".join(f"{c.first_run}: `{c.commit}`" for c in epoch) or "before every change"


def changed(later: tuple[Change, ...]) -> str:
    """Whether a cell is the current code: "yes", or the first change since (and how many)."""
    if not later:
        return "yes"
    more = f" and {len(later) - 1} more" if len(later) > 1 else ""
    return f"no: `{later[0].commit}` ({later[0].first_run}){more}"


def row(*cells_: str) -> str:
    return "| " + " | ".join(cells_) + " |"


def header(*names: str) -> list[str]:
    return [row(*names), "|" + "---|" * len(names)]


PROMPT = {"hit-partial": "hit-partial", "hit-full": "hit-full (1 block)"}


def prompt_name(p: str) -> str:
    return PROMPT.get(p) or f"{int(p[3:]):,}"


@dataclass(frozen=True)
class Data:
    """The raw files and their cells, read once per report: the engines' records
    (``docs/gpu/``), the chunk-pace bench's JSON, the K/V transfer bench's output and the CPU
    benches' records (``docs/bench/``)."""

    records: Records
    pairs: tuple[PairCell, ...]
    starts: tuple[StartCell, ...]
    pace: tuple[tuple[str, dict], ...]
    kv_reads: tuple[kv_bench.Read, ...]
    bench_runs: tuple[bench.BenchRun, ...] = ()
    bench_cells: tuple[bench.BenchCell, ...] = ()

    @classmethod
    def load(cls, root: Path = ROOT) -> Data:
        gpu = root / "docs" / "gpu"
        r = records.load(gpu)
        pace = tuple((p.name, json.loads(p.read_text()))
                     for p in sorted(gpu.glob("*-pace-*.json")))
        runs = bench.load(root / "docs" / "bench")
        return cls(r, tuple(cells.pair_cells(r)), tuple(cells.start_cells(r)), pace,
                   tuple(kv_bench.load(root / "docs" / "gpu_runs")), runs,
                   bench.cells(runs, *bench.changes()))

    def geometries(self) -> list[str]:
        return list(dict.fromkeys(c.geometry for c in self.pairs))


def _pair_order(c: PairCell) -> tuple:
    return c.release, c.name, run_order(c.epoch[0].first_run) if c.epoch else (0, "")


def models(data: Data) -> str:
    used = dict.fromkeys([c.geometry for c in data.pairs] + [s.run.geometry
                                                            for s in data.records.starts])
    lines = header("in the tables", "the model as it was")
    lines += [row(kv_of(g), model(g)) for g in used]
    return "\n".join(lines)


def epochs(_: Data) -> str:
    lines = header("first run", "commit", "paths", "vLLM", "what changed")
    for c in CHANGES:
        lines.append(row(c.first_run, f"`{c.commit}`", ", ".join(sorted(c.paths)),
                         _releases(c), c.why))
    lines += ["", "Kept inside their epoch (not a new cell):", ""]
    lines += header("first run", "commit", "paths", "why kept")
    lines += [row(c.first_run, f"`{c.commit}`", ", ".join(sorted(c.paths)), c.why) for c in KEPT]
    lines += ["", "Stock pairs taken from another run: "
              + "; ".join(f"run {a}'s against run {b}'s" for a, b in STOCK_FROM.items()) + "."]
    return "\n".join(lines)


def _releases(c: Change) -> str:
    low, high = c.releases
    if low is None and high is None:
        return "all"
    return f"{low or ''}\N{EN DASH}{high or ''}"


def transfer(data: Data) -> str:
    """Per model: each pdpatch scenario's D-side NIXL time over its stock pair's, per prompt."""
    out: list[str] = []
    for g in data.geometries():
        group = sorted((c for c in data.pairs if c.geometry == g
                        and any(c.ratios(p) for p in c.prompts())), key=_pair_order)
        if not group:
            continue
        prompts = ordered_prompts(p for c in group for p in c.prompts())
        out += [f"**{kv_of(g)}**: {model(g)}.", ""]
        out += header("vLLM", "P -> D", "pdpatch", "epoch", "runs", "÷ stock pair",
                      *map(prompt_name, prompts), "answers (stock pair's own)", "current code")
        for c in group:
            out.append(row(c.release, pair_of(c.backends, c.tp), setting(c.name), since(c.epoch),
                           ", ".join(c.runs()), ", ".join(c.stock_runs()),
                           *(spread(c.ratios(p)) for p in prompts),
                           f"{c.judged().text()} ({c.stock_judged().text()})",
                           changed(c.superseded)))
        out.append("")
    return "\n".join(out).rstrip()


def first_request(data: Data) -> str:
    """Each pair's first P/D request (its first contact with P) over the stock pair's."""
    lines = header("vLLM", "KV", "P -> D", "pdpatch", "epoch", "runs", "ratio", "pdpatch pair "
                   "measured first / second", "geometric mean [95 % t], df",
                   "stock's first request, ms", "current code")
    order = data.geometries()
    for c in sorted(data.pairs, key=lambda c: (order.index(c.geometry), *_pair_order(c))):
        got = c.first_requests()
        if not got:
            continue
        ratios = [r for r, _ in got]
        first = sum(f for _, f in got)
        stock = [next(iter(p.stock.requests.values())).ms for p in c.pairs
                 if p.stock and p.scenario.requests]
        lines.append(row(c.release, kv_of(c.geometry), pair_of(c.backends, c.tp),
                         setting(c.name), since(c.epoch), ", ".join(c.runs()),
                         spread(Spread.of(ratios)), f"{first} / {len(got) - first}",
                         geo(Interval.of(ratios), _two), spread(Spread.of(stock)),
                         changed(c.superseded)))
    return "\n".join(lines)


def _two(x: float) -> str:
    return f"{x:.2f}"


def start_epoch(c: StartCell) -> str:
    return "stock: no pdpatch path" if c.control else since(c.epoch)


def on_pair(c: StartCell) -> str:
    if c.control:
        return "stock (A/A control)"
    env = dict(c.on_env)
    return ", ".join(f"`{k}={v}`" for k, v in env.items()) or "pdpatch's defaults"


SPEED_LENGTHS = ("100", "600", "1500", "4000", "16000")


def ttft_table(data: Data) -> str:
    """Per configuration and epoch: the starts' median paired TTFT ratio (on/off)."""
    lines = header("vLLM", "KV", '"on" pair', "epoch", "runs", '"on" started first / second',
                   "TTFT on/off: starts' medians", "geometric mean [95 % t], df",
                   *(f"{int(n):,} tokens" for n in SPEED_LENGTHS),
                   "decode throughput off/on", "D's NIXL time on/off, rounds",
                   "outputs identical", "current code")
    for c in sorted(data.starts, key=lambda c: (c.release, c.geometry, c.control, c.on_env,
                                                 run_order(c.runs()[0]))):
        lines.append(row(c.release, kv_of(c.geometry), on_pair(c), start_epoch(c),
                         ", ".join(c.runs()), c.orders(),
                         spread(Spread.of(c.ratios()), ttft), geo(c.interval()),
                         *(spread(c.by_length(n), ttft) for n in SPEED_LENGTHS),
                         spread(c.tput()), spread(c.xfer()), c.identical(),
                         changed(c.superseded)))
    return "\n".join(lines)


def stock(data: Data) -> str:
    """What one stock configuration's D-side NIXL time reads from run to run (ms)."""
    times = cells.stock_times(data.records)
    out: list[str] = []
    for g in data.geometries():
        keys = [k for k in times if k[1] == g]
        if not keys:
            continue
        prompts = ordered_prompts(p for k in keys for p in times[k])
        out += [f"**{kv_of(g)}**", ""]
        out += header("vLLM", "P -> D", "prefix caching", "runs",
                      *map(prompt_name, prompts))
        for k in keys:
            got = times[k]
            runs = dict.fromkeys(r for xs in got.values() for r, _ in xs)
            out.append(row(k[0], pair_of(k[3], k[2]), "on" if k[4] else "off", ", ".join(runs),
                           *(spread(Spread.of([x for _, x in got[p]])) if p in got else ""
                             for p in prompts)))
        out.append("")
    return "\n".join(out).rstrip()


def answers(data: Data) -> str:
    """Every scenario of every run as its own run judged it."""
    lines = header("run", "vLLM", "KV", "scenario", "P -> D", "answers", "identical to the "
                   "stock pair's", "under load", "notes")
    for s in data.records.scenarios:
        j = cells.judged_in_run(s)
        same = [r.same_as_stock for r in s.requests.values() if r.same_as_stock is not None]
        load = f"{s.load[0]}/{s.load[1]} intact" + (f", {s.load[2]} not judged"
                                                     if s.load[2] else "") if s.load else ""
        lines.append(row(s.run.letter, s.run.release, kv_of(s.run.geometry), s.name,
                         pair_of(s.backends, s.tp), j.text(),
                         f"{sum(same)}/{len(same)}" if same else "", load,
                         "; ".join(filter(None, [s.error[:80], *s.notes]))))
    return "\n".join(lines)


def runs(data: Data) -> str:
    """Each run: its files, release, model, GPUs."""
    info = {s.run.file: s.run for s in (*data.records.scenarios, *data.records.starts)}
    lines = header("run", "files in docs/gpu/", "vLLM", "KV", "GPUs", "prefix caching")
    for letter, files in data.records.runs().items():
        r = info[files[0]]
        lines.append(row(letter, ", ".join(f"`{f}`" for f in files), r.release,
                         kv_of(r.geometry), r.gpus, "on" if r.prefix_caching else "off"))
    return "\n".join(lines)


def chunk_pace(data: Data) -> str:
    """``scripts/bench_chunk_pace.py`` (``docs/gpu/*-pace-*.json``): a converted request through
    the staging agent per staging size, lanes, share and gather, against vLLM's per-segment READ
    of the same request in the same run."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for name, d in data.pace:
        asked = {int(x) for x in str(d["args"].get("p_runs", "")).split(",") if x}
        for c in d["chunked"]:
            blocks = c.get("p_run")
            run = f"runs of {blocks}" if blocks in asked else "one run"
            key = (name, int(c["request_mib"]), run, c["capacity_mib"], c["lanes"],
                   c["share"], c.get("gather", "per-chunk"))
            groups.setdefault(key, []).append((c["ms"], c["ms"] / c["per_segment_ms"]))
    lines = header("file", "request MiB", "P's blocks", "staging MiB", "lanes", "share",
                   "gather prepared", "staged ms", "÷ per-segment READ")
    for key, got in groups.items():
        lines.append(row(f"`{key[0]}`", *map(str, key[1:]), spread(Spread.of([a for a, _ in got])),
                         spread(Spread.of([b for _, b in got]))))
    return "\n".join(lines)


def kv_bench_table(data: Data) -> str:
    """The K/V transfer bench: converted READs (fused <-> split) per mode, against the fused
    path and vLLM's per-segment READ of the same cell."""
    lines = header("series (`docs/gpu_runs/`)", "READ", "files", "cells", ">= 0.9 of the fused "
                   "path", "÷ fused path", "÷ vLLM's per-segment READ")
    for r in kv_bench.rows(list(data.kv_reads)):
        lines.append(row(f"`{r.series}`", f"`{r.mode}`", str(r.files), str(r.cells),
                         f"{r.at_least_0_9}/{r.cells}", spread(r.x_fused), spread(r.x_vllm)))
    return "\n".join(lines)


def _pair(data: Data, release: str, geometry: str, name: str) -> PairCell | None:
    """The latest epoch's cell of a configuration (selected by its key, never by its value)."""
    got = [c for c in data.pairs if (c.release, c.geometry, c.name) == (release, geometry, name)]
    return max(got, key=_pair_order, default=None)


def coalescing(data: Data) -> str:
    """For ``docs/coalescing.md``: the latest epoch of every configuration that coalesces (a
    same-layout peer's READs staged, ``PDPATCH_KV_COALESCE=1``), with its longest prompt."""
    keys = dict.fromkeys((c.release, c.geometry, c.name) for c in data.pairs
                         if SCENARIOS[c.name].d_env.get("PDPATCH_KV_COALESCE") == "1")
    lines = header("vLLM", "KV", "P -> D", "pdpatch", "runs", "1,500 tokens", "longest prompt",
                   "one block (hit-full)", "first P/D request", "answers", "current code")
    for key in sorted(keys):
        c = _pair(data, *key)
        longest = [p for p in ordered_prompts(c.prompts()) if p.startswith("len")][-1]
        first = [r for r, _ in c.first_requests()]
        lines.append(row(c.release, kv_of(c.geometry), pair_of(c.backends, c.tp),
                         setting(c.name), str(len(c.runs())), spread(c.ratios("len1500")),
                         f"{prompt_name(longest)}: {spread(c.ratios(longest))}",
                         spread(c.ratios("hit-full")),
                         spread(Spread.of(first)) if first else "", c.judged().text(),
                         _now(c.current())))
    return "\n".join(lines)


def _start(data: Data, release: str, geometry: str, env: tuple) -> StartCell | None:
    got = [c for c in data.starts if (c.release, c.geometry, c.on_env, c.control)
           == (release, geometry, env, False)]
    return max(got, key=lambda c: run_order(c.runs()[0]), default=None)


README_ROWS = (
    ("0.25.1", "llama3-8b", "coalesce", ("len1500", "len16000", "first")),
    ("0.25.1", "llama3-70b-tp2", "coalesce", ("len1500", "first")),
    ("0.25.1", "llama3-8b", "kvc", ("len1500",)),
    ("0.33.0", "llama3-70b", "coalesce-tp12", ("len1500",)),
)
"""The README's transfer rows: (release, geometry, scenario, measures), each from the latest
epoch's cell of its key; a measure is a prompt (D's KV transfer time ÷ stock's) or ``first``
(the first P/D request ÷ stock's)."""
README_REPEATED = (
    ("0.25.1", "llama3-8b-full", "coalesce", "fresh", ("len1500", "len16000")),
    ("0.26.0", "llama3-8b", "coalesce-aged", "aged", ("len1500", "len16000")),
    ("0.34.0", "llama3-8b", "coalesce", "fresh", ("len1500", "len16000")),
)
"""The README's rows of repeated samples (release, geometry, scenario, D fresh or aged,
prompts): per prompt, each pair start's median D-side NIXL time over its stock pair's."""
README_TTFT = (("0.25.1", "llama3-8b", ()), ("0.33.0", "llama3-8b", ()),
               ("0.25.1", "llama3-8b", (("PDPATCH_KV_COALESCE", "1"),)))
"""The README's TTFT rows: (release, geometry, the "on" pair's settings)."""


def _now(current: bool) -> str:
    return "yes" if current else "no: changed since"


def results(data: Data) -> str:
    """The README's one results table: the headline cells, no run letters or commits."""
    lines = header("pdpatch, model's KV", "vLLM, P -> D", "measured", "median (range, n)",
                   "95 % t-interval", "answers", "current code")
    for release, g, name, measures in README_ROWS:
        c = _pair(data, release, g, name)
        if c is None:
            raise SystemExit(f"no GPU record of {name} at {g} on vLLM {release}")
        what, where = f"{setting(name)}, {kv_of(g)}", f"{release}, TP {c.tp[0]} -> {c.tp[1]}"
        for m in measures:
            if m == "first":
                first = [r for r, _ in c.first_requests()]
                lines.append(row(what, where, "first P/D request ÷ stock's",
                                 spread(Spread.of(first)), geo(Interval.of(first), _two), "",
                                 _now(c.current())))
            else:
                lines.append(row(what, where, f"KV transfer time ÷ stock's, {prompt_name(m)} "
                                 "tokens", spread(c.ratios(m)), "", c.judged().text(),
                                 _now(c.current())))
    for release, g, name, phase, prompts in README_REPEATED:
        c = _pair(data, release, g, name)
        if c is None:
            raise SystemExit(f"no GPU record of {name} at {g} on vLLM {release}")
        on = " on an aged D" if phase == "aged" else ""
        for m in prompts:
            ratios = repeated.start_ratios(c, m, phase)
            samples = repeated.pooled(c, m, phase, stock=False)
            lines.append(row(f"{setting(name)}, {kv_of(g)}",
                             f"{release}, TP {c.tp[0]} -> {c.tp[1]}",
                             f"KV transfer time ÷ stock's{on}, {prompt_name(m)} tokens, "
                             f"{len(samples)} requests, per pair start",
                             spread(Spread.of(ratios)),
                             geo(Interval.of(ratios), _two), repeated.answers(samples),
                             _now(c.current())))
    for release, g, env in README_TTFT:
        s = _start(data, release, g, env)
        if s is None:
            raise SystemExit(f"no TTFT starts at {g} on vLLM {release} with {env}")
        lines.append(row(f"{'coalesced READs' if env else 'defaults'}, {kv_of(g)}",
                         f"{release}, TP 1 -> 1", "TTFT on ÷ off, per pair start",
                         spread(Spread.of(s.ratios()), ttft), geo(s.interval()),
                         f"outputs identical {s.identical()}", _now(s.current())))
    return "\n".join(lines)


def ttft_defaults(data: Data) -> str:
    """One sentence for ``docs/patches.md``: TTFT with pdpatch's defaults, every start of the
    current epoch, beside the A/A control."""
    s = _start(data, "0.25.1", "llama3-8b", ())
    aa = [c for c in data.starts if c.control and c.geometry == "llama3-8b"]
    line = (f"TTFT on vs off with pdpatch's defaults (vLLM 0.25.1, {model('llama3-8b')}, whose "
            f"prefill compute is a tiny model's): geometric mean {geo(s.interval())} over "
            f"{len(s.starts)} pair starts (the starts' medians "
            f"{spread(Spread.of(s.ratios()), ttft)})")
    if aa:
        line += f"; two stock pairs against each other: {geo(aa[0].interval())} over " \
                f"{len(aa[0].starts)} starts"
    return line + " ([GPU results](gpu_results.md#ttft))."


def _bench_since(c: bench.Change) -> str:
    return f"`{c.commit}` ({c.first_run.split('-', 1)[1] if c.first_run else 'not yet measured'})"


def _bench_current(later: tuple[bench.Change, ...]) -> str:
    if not later:
        return "yes"
    more = f" and {len(later) - 1} more" if len(later) > 1 else ""
    return f"no: {_bench_since(later[0])}{more}"


def cpu_benchmarks(data: Data) -> str:
    """The CPU benches' figures (``docs/bench/*.json``): per bench, command, vLLM, machine and
    code epoch, every run pooled; each figure n runs, median and range, a t-interval from three."""
    lines = header("bench", "vLLM", "command", "code since", "runs (`docs/bench/`)",
                   "machine; 1-min load before → after, per run", "figure",
                   "median (range, n runs)", "geometric mean [95 % t], df", "current code")
    for c in data.bench_cells:
        env = " ".join(f"`{k}={v}`" for k, v in c.env if k not in bench.SET_BY_BENCH)
        first = [f"`{c.bench}`", c.vllm, f"`{c.command}`" + (f" with {env}" if env else ""),
                 _bench_since(c.epoch),
                 ", ".join(r.short + (" (uncommitted changes)" if r.dirty else "")
                           for r in c.runs),
                 f"{c.machine}; " + ", ".join(f"{r.load_before:.1f} → {r.load_after:.1f}"
                                               for r in c.runs)]
        figs = bench.figures(c)
        if not figs:
            raise SystemExit(f"no figure of {c.bench} in {', '.join(r.name for r in c.runs)}")
        for i, (key, label) in enumerate(figs):
            i_ = c.interval(key)
            if key in bench.COUNTS:
                interval = "a count"
            elif i_ or len(c.values(key)) < 3:
                interval = geo(i_, num)
            else:
                interval = "not a positive quantity"
            lines.append(row(*(first if i == 0 else [""] * len(first)), label,
                             spread(c.spread(key)), interval,
                             _bench_current(c.superseded) if i == 0 else ""))
    return "\n".join(lines)


def bench_epochs(data: Data) -> str:
    """The CPU benches' reviewed epochs (``lab/report/bench_epochs.json``)."""
    change, kept = bench.changes()
    lines = header("bench", "first run", "commit", "what changed")
    lines += [row(f"`{c.bench}`", c.first_run.split("-", 1)[1] if c.first_run
                  else "not yet measured", f"`{c.commit}`", c.why) for c in change]
    if kept:
        lines += ["", "Kept inside their epoch (not a new cell):", ""]
        lines += header("bench", "run", "commit", "why kept")
        lines += [row(f"`{c.bench}`", c.first_run.split("-", 1)[1], f"`{c.commit}`", c.why)
                  for c in kept]
    return "\n".join(lines)


BLOCKS: dict[str, Callable[[Data], str]] = {
    "models": models, "epochs": epochs, "transfer": transfer, "first-request": first_request,
    "ttft": ttft_table, "stock": stock, "answers": answers, "runs": runs,
    "chunk-pace": chunk_pace, "kv-bench": kv_bench_table, "coalescing": coalescing,
    "results": results,
    "ttft-defaults": ttft_defaults,
    "cpu-benchmarks": cpu_benchmarks, "bench-epochs": bench_epochs,
    **repeated.BLOCKS,
}
"""Every block the report writes, by the name its markers give."""
