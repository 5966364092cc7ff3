"""A run's summary as the plain text the launcher and the benchmarks print.

`format_summary` is the table a run ends with; `compare_modes` and `compare_bytes` put the
summaries of several modes side by side. The small formatters below it (`format_number`,
`format_percent`, `ratio`, `mode_order`) are shared with `launcher.plots` and
`launcher.progress`. Sizes are decimal: 1 MB = 10^6 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from common.spec import MODES
from launcher.summary import HELPERS, THREAD_GROUPS, RunSummary
from trainer.records import BYTE_KINDS, TermRecord

MB = 1e6


def format_number(value: float, fmt: str) -> str:
    """`value` in `fmt`, or n/a for NaN (a figure with no data)."""
    return "n/a" if value is None or math.isnan(value) else format(value, fmt)


def format_percent(value: float) -> str:
    """A fraction as a percentage with one decimal and its unit, or n/a."""
    return "n/a" if math.isnan(value) else f"{100 * value:.1f} %"


def ratio(num: float, den: float) -> float:
    """num / den; NaN where the denominator is not positive or the numerator is NaN."""
    return num / den if den > 0 and not math.isnan(num) else math.nan


def mode_order(names: Iterable[str]) -> list[str]:
    """The modes among `names` in `common.spec.MODES` order, then any others by name."""
    names = list(names)
    return [m for m in MODES if m in names] + sorted(n for n in names if n not in MODES)


def format_summary(summary: RunSummary) -> str:
    """A plain-text table of `summary` (at most 100 columns), ending without a newline."""
    s = summary
    ev = s.eval
    status = "finished" if s.finished else "in progress"
    warm = f", first {s.warmup} excluded as warm-up" if s.warmup else ""
    warm += f", last {s.cooldown} excluded" if s.cooldown else ""
    rows: list[tuple[str, str, str]] = [
        ("throughput", format_number(s.samples_per_s, ",.1f"), "samples/s"),
        ("iteration time", format_number(1e3 * s.iteration_time_s, ",.2f"), "ms"),
        ("wall time", format_number(s.wall_time_s, ",.2f"), f"s ({s.samples:,} samples timed)"),
        ("hit rate", format_percent(s.hit_rate).removesuffix(" %"), "%"),
        ("fetched", format_number(s.fetch_bytes_per_iter / MB, ",.3f"),
         f"MB/iter ({s.fetch_rows_per_iter:,.1f} rows)"),
        ("written back", format_number(s.write_back_bytes_per_iter / MB, ",.3f"),
         f"MB/iter ({s.write_back_rows_per_iter:,.1f} rows)"),
        ("synchronised", format_number(s.sync_bytes_per_iter / MB, ",.3f"),
         f"MB/iter ({s.sync_rows_per_iter:,.1f} rows, {s.join_rows_per_iter:,.1f} joins)"),
        ("machinery", format_number(1e3 * s.machinery_s, ",.2f"),
         "ms/iter (all but forward, backward and the dense optimizer step)"),
        ("compute CPU", format_number(1e3 * sum(s.compute_cpu_s.values(), 0.0) if s.compute_cpu_s
                                      else math.nan, ",.2f"),
         "ms/iter of CPU in forward, backward and the dense step"),
        ("final loss", format_number(s.final_loss, ".4f"), f"(mean of last {s.loss_window} iterations)"),
    ]
    if s.cpu_us_per_sample:  # the records of an older trainer have no thread samples
        cpu = s.cpu_us_per_sample
        rows.insert(rows.index(next(r for r in rows if r[0] == "final loss")), (
            "trainer CPU", format_number(sum(cpu.get(g, 0.0) for g in THREAD_GROUPS), ",.1f"),
            f"µs/sample: {cpu['training_thread_compute']:,.1f} compute, {cpu['training_thread_other']:,.1f} "
            f"else on the training thread, {cpu['other_threads']:,.1f} other threads"
            + (f", and {cpu[HELPERS]:,.1f} in its helper process" if HELPERS in cpu else "")))
    if s.checkpoints:
        rows.append(("checkpoints", f"{s.checkpoints:,}",
                     f"taken: {format_number(s.checkpoint_bytes / MB, ',.2f')} MB and "
                     f"{format_number(s.checkpoint_s, '.2f')} s each (PS snapshots + dense model)"))
    if ev is not None:
        rows += [
            ("eval AUC", format_number(ev.auc, ".4f"), f"(iteration {ev.iteration}, {ev.count:,} samples)"),
            ("eval log loss", format_number(ev.log_loss, ".4f"), ""),
        ]
    lines = [
        f"Run summary: mode {s.mode}, {s.trainers} trainer(s), global batch {s.global_batch:,}, "
        f"{status}",
        f"  iterations {s.first_iteration}..{s.last_iteration} ({s.iterations} measured{warm})",
    ]
    lines += [f"  {name:<16}{value:>14}  {unit}".rstrip() for name, value, unit in rows]
    lines += _format_phases(s.phase_s)
    return "\n".join(lines)


def _format_phases(phase_s: Mapping[str, float]) -> list[str]:
    total = sum(phase_s.values())
    lines = ["Phase breakdown (mean per iteration and trainer)",
             f"  {'phase':<16}{'ms':>14}  {'share':>7}"]
    for name, sec in phase_s.items():
        share = sec / total if total > 0 else 0.0
        bar = "#" * round(40 * share)
        lines.append(f"  {name:<16}{1e3 * sec:>14,.3f}  {100 * share:>6.1f}%  {bar}".rstrip())
    lines.append(f"  {'total':<16}{1e3 * total:>14,.3f}  (the phases add up to the iteration)")
    return lines


def compare_modes(summaries: Mapping[str, RunSummary]) -> str:
    """One row per mode (bagpipe, no-cache, static-cache, local, then any others by name):
    samples/s, iteration time, hit rate, fetched and synchronised MB per iteration, and the
    throughput relative to `local` and to `no-cache` when those modes are present."""
    ratio_to = [m for m in ("local", "no-cache") if m in summaries]
    head = (f"{'mode':<14}{'samples/s':>12}{'iter ms':>10}{'hit rate':>10}"
            f"{'fetch MB/it':>13}{'sync MB/it':>12}")
    head += "".join(f"{'vs ' + m:>13}" for m in ratio_to)
    lines = [head, "-" * len(head)]
    for name in mode_order(summaries):
        s = summaries[name]
        line = (f"{name:<14}{format_number(s.samples_per_s, ',.1f'):>12}"
                f"{format_number(1e3 * s.iteration_time_s, ',.2f'):>10}{format_percent(s.hit_rate):>10}"
                f"{format_number(s.fetch_bytes_per_iter / MB, ',.3f'):>13}"
                f"{format_number(s.sync_bytes_per_iter / MB, ',.3f'):>12}")
        for m in ratio_to:
            vs = ratio(s.samples_per_s, summaries[m].samples_per_s)
            line += f"{format_number(vs, '.2f') + ('' if math.isnan(vs) else 'x'):>13}"
        lines.append(line)
    return "\n".join(lines)


def compare_bytes(summaries: Mapping[str, RunSummary]) -> str:
    """One row per mode: payload MB per iteration and trainer of each kind of traffic (PS
    fetches and write-backs, embedding sync now and later, joins, the dense gradients DDP
    all-reduces), and their total."""
    kinds = [k.removesuffix("_bytes").replace("_", " ") for k in BYTE_KINDS]
    head = f"{'mode':<14}" + "".join(f"{k:>12}" for k in kinds) + f"{'total':>10}"
    lines = [head, "-" * len(head)]
    for name in mode_order(summaries):
        s = summaries[name]
        per = [s.bytes_per_iter.get(k, math.nan) / s.trainers / MB for k in BYTE_KINDS]
        lines.append(f"{name:<14}" + "".join(f"{format_number(v, ',.3f'):>12}" for v in per)
                     + f"{format_number(sum(per), ',.3f'):>10}")
    return "\n".join(lines)


def format_terms(terms: Sequence[TermRecord]) -> str:
    """An elastic run's terms: how many trainers trained from which iteration (the summary
    above is the last term's)."""
    lines = ["trainers over the run (the summary above is of the last term):"]
    for t in terms:
        lines.append(f"  term {t.term}: {t.trainers} trainer(s) from iteration {t.first_iteration}")
    return "\n".join(lines)


def format_stream(stream: Mapping[str, Any]) -> str:
    """A stream's run (`oracle.service.OracleService.stream_summary`): what it took, and how
    far the trainers were behind its newest rows."""
    return "\n".join([
        "Stream (rows trained as they arrived)",
        f"  parts {stream['parts']}, rows {stream['rows']:,} ({stream['bad_rows']:,} malformed, quarantined), "
        f"{stream['iterations']} iterations, plan cut {stream['cuts']} time(s) where the trainers caught up",
        f"  lag behind the newest rows: p50 {stream['lag_s_p50']:.2f} s, p99 {stream['lag_s_p99']:.2f} s, "
        f"max {stream['lag_s_max']:.2f} s and {stream['lag_rows_max']:,} rows",
        *([f"  freshness (a row's arrival to the first export trained on it), over {stream['exports']} export(s): "
           f"p50 {stream['freshness_s_p50']:.2f} s, p99 {stream['freshness_s_p99']:.2f} s"] if "exports" in stream else []),
    ])
