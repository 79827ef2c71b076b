"""``zephon diff A B``: from which step two runs' batches part, and what differs between them.

``A`` and ``B`` are each a fingerprint log (what ``zephon fingerprints`` prints: one
``STEP SHA256 [name=count ...]`` line per step) or a loader config (``.toml`` / ``.json``,
then ``--steps START:END`` is required and its fingerprints are computed with
:func:`loader.commands.fingerprints.collect_fingerprints`, one rank, in this process). The report:

- the first step whose line differs, the steps before it that agree, how many differ;
- for that step, the sequences that differ (position in the batch, global index, lane
  ``i mod L``, source on each side) when both sides are configs (a log holds only the
  step's hash and per-source counts, so then the counts are compared);
- with two configs: the config fields that differ, each classed as ``stream`` (one of
  :meth:`LoaderConfig.stream_fields`), ``input`` (datasets, tokenizer, special tokens,
  schedule: what is read and mixed) or ``runtime`` (fields that never change the batches),
  the effective mixture schedule and the first step from which it differs, and per dataset
  the manifest fields that differ (fingerprint, seed, lanes, files per lane, documents,
  tokenizer, schema, rejects) and the names of lane files changed, added or removed;
- ``causes``: which of those differences can explain the first differing step. Batches that
  differ while only ``runtime`` fields do is a determinism bug, and says so;
- ``transforms``: when the steps differ and a source has transforms (two configs, or two logs
  with ``--config`` naming the config the runs used), the transform that is not a function of
  its document, named with its position, version and spec SHA-256, found by trying each on
  the documents of the first differing sequence's lane (:mod:`loader.commands.transform_culprit`);
  it is listed first among the causes.

Exit status, as ``diff(1)`` and ``cmp(1)``: 0 when the two sides agree on every step and
cover the same steps, 1 when they differ, 2 for any error (a malformed log, a bad config,
a missing file or dataset): a script can tell "different" from "could not compare".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any, Optional, Sequence

from loader.cli import run_command, USER_FILE_ERRORS
from loader.commands.fingerprints import SUPERVISED_MARKER, StepFingerprint, _parse_steps, collect_fingerprints
from loader.commands.transform_culprit import find_culprit
from loader.config import LoaderConfig
from loader.errors import DiffError, ZephonError
from loader.io.manifest import Manifest, read_manifest
from loader.io.storage_options import SHA256_HEX
from loader.order.mixing import exact_weights

IDENTICAL_EXIT = 0
DIFFERENT_EXIT = 1
TROUBLE_EXIT = 2
CONFIG_SUFFIXES = (".toml", ".json")
LOG_FORMAT = "`STEP SHA256 [name=count ...] [supervised: name=count ...]`, as `zephon fingerprints` prints"
# ASCII digits, at most 18: str.isdigit() accepts "²" and int() refuses it, and int() refuses
# strings of more than 4,300 digits (both bare ValueErrors otherwise).
NUMBER = r"[0-9]{1,18}"
COUNT = re.compile(rf"([^=\s]+)=({NUMBER})")
STEP = re.compile(NUMBER)
# LoaderConfig fields that never change the batches (their FIELD_DOCS: the configuration reference).
RUNTIME_FIELDS = frozenset({
    "micro_batch_size", "num_workers", "prefetch", "cache_dir", "cache_max_bytes", "verify_checksums",
    "verify_local_files", "storage_endpoint", "storage", "worker_timeout_s", "read_ahead", "read_ahead_threads",
    "batch_fields", "step_states_kept", "metrics_log_every_steps",
    # which rank trains on which of a step's sequences, not what the step holds (a resume keeps it, though)
    "balance",
})
TEXT_SEQUENCES_SHOWN = 16  # the text report lists this many differing sequences; --json lists all


# -- fingerprint logs ----------------------------------------------------------------------
def _parse_counts(parts: Sequence[str], where: str, got: str, what: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for part in parts:
        match = COUNT.fullmatch(part)
        if match is None:
            raise DiffError(f"{where}: {what} are name=count, got {part!r:.80}; expected {LOG_FORMAT}")
        if match[1] in counts:
            raise DiffError(f"{where}: source {match[1]!r} is counted twice in the {what} {got}")
        counts[match[1]] = int(match[2])
    return counts


def parse_log_line(text: str, where: str) -> StepFingerprint:
    """One ``STEP SHA256 [name=count ...] [supervised: name=count ...]`` line (the supervised
    counts only with a ``loss_mask`` source); ``where`` (``file:line``) starts every error."""
    parts = text.split()
    got = f"(got {text.strip()!r:.120})"
    if len(parts) < 2:
        raise DiffError(f"{where}: expected {LOG_FORMAT} {got}")
    step, sha = parts[0], parts[1]
    if not STEP.fullmatch(step):
        raise DiffError(f"{where}: the step must be a non-negative integer (ASCII digits, at most 18), got "
                        f"{step!r:.80}; expected {LOG_FORMAT}")
    if not SHA256_HEX.fullmatch(sha):
        raise DiffError(f"{where}: the hash must be 64 lowercase hex digits, got {sha!r:.80}; expected {LOG_FORMAT}")
    rest = parts[2:]
    cut = rest.index(SUPERVISED_MARKER) if SUPERVISED_MARKER in rest else len(rest)
    counts = _parse_counts(rest[:cut], where, got, "per-source counts")
    supervised = _parse_counts(rest[cut + 1:], where, got, "supervised-token counts")
    if cut < len(rest) and not supervised:
        raise DiffError(f"{where}: {SUPERVISED_MARKER!r} must be followed by name=count per source {got}")
    return StepFingerprint(int(step), sha, counts, supervised_counts=supervised)


def parse_log(path: str) -> list[StepFingerprint]:
    """A fingerprint log, in step order. Blank lines and ``#`` comments are skipped; a step
    listed twice, a malformed line or an empty log is a :class:`DiffError` naming the line."""
    with open(path, "rb") as fh:  # missing / a directory: reported as a file error
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DiffError(f"{path}: a fingerprint log is UTF-8 text ({exc}); expected lines {LOG_FORMAT}") from exc
    results: list[StepFingerprint] = []
    line_of_step: dict[int, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        result = parse_log_line(line, f"{path}:{number}")
        if result.step in line_of_step:
            raise DiffError(f"{path}:{number}: step {result.step} is already on line {line_of_step[result.step]}; "
                            "a log holds one line per step (concatenated logs of two runs?)")
        line_of_step[result.step] = number
        results.append(result)
    if not results:
        raise DiffError(f"{path}: holds no fingerprint lines; expected one line per step, {LOG_FORMAT}")
    return sorted(results, key=lambda r: r.step)


# -- one side of the comparison --------------------------------------------------------------
@dataclass
class Side:
    """What is known of one run: its step fingerprints and, for a config, its inputs."""

    label: str  # "A" or "B"
    path: str
    steps: dict[int, StepFingerprint]
    config: Optional[LoaderConfig] = None
    manifests: list[Manifest] = field(default_factory=list)
    source_names: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "config" if self.config is not None else "log"

    def describe(self) -> dict[str, Any]:
        steps = sorted(self.steps)
        return {"path": self.path, "kind": self.kind, "steps": [steps[0], steps[-1]] if steps else None,
                "num_steps": len(steps)}


def is_config_path(path: str) -> bool:
    return path.endswith(CONFIG_SUFFIXES)


def load_side(label: str, path: str, steps: Optional[tuple[int, int]]) -> Side:
    if not is_config_path(path):
        logged = parse_log(path)
        if steps is not None:
            inside = [r for r in logged if steps[0] <= r.step < steps[1]]
            if not inside:
                raise DiffError(f"{path}: no step of the log is in --steps {steps[0]}:{steps[1]} (the log has steps "
                                f"{logged[0].step}..{logged[-1].step})")
            logged = inside
        return Side(label, path, {r.step: r for r in logged})
    if steps is None:
        raise DiffError(f"{path} is a loader config: pass --steps START:END to compare its fingerprints "
                        "(or compare two logs written by `zephon fingerprints`)")

    config = LoaderConfig.from_file(path)
    results, _ = collect_fingerprints(config, world_size=1, start_step=steps[0], end_step=steps[1],
                                      keep_sequences=True)
    manifests = [read_manifest(d.path, config.storage_options()) for d in config.datasets]
    names = [d.name or m.source_name for d, m in zip(config.datasets, manifests)]
    return Side(label, path, {r.step: r for r in results}, config, manifests, names)


# -- steps and sequences ---------------------------------------------------------------------
def _step_line(result: StepFingerprint) -> dict[str, Any]:
    line: dict[str, Any] = {"sha256": result.sha256, "source_counts": result.source_counts}
    if result.supervised_counts:  # a line without them reports as it did before
        line["supervised_counts"] = result.supervised_counts
    return line


def differing_sequences(a: Side, b: Side, step: int) -> list[dict[str, Any]]:
    """The positions of step ``step`` whose sequence differs (both sides configs)."""
    seq_a, seq_b = a.steps[step].sequences, b.steps[step].sequences
    num_lanes = a.manifests[0].num_lanes if a.manifests else None
    batch = a.config.global_batch_size
    out = []
    for position in range(max(len(seq_a), len(seq_b))):
        left = seq_a[position] if position < len(seq_a) else None
        right = seq_b[position] if position < len(seq_b) else None
        if left == right:
            continue
        index = step * batch + position
        out.append({
            "position": position, "global_index": index,
            "lane": index % num_lanes if num_lanes else None,
            "a": {"sha256": left[0], "source": left[1]} if left else None,
            "b": {"sha256": right[0], "source": right[1]} if right else None,
        })
    return out


# -- configs, schedules, manifests -------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A JSON-able copy of a config value (tuples of dataclasses become lists of dicts)."""
    return json.loads(json.dumps(value, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o)))


def config_differences(a: LoaderConfig, b: LoaderConfig) -> list[dict[str, Any]]:
    """Every config field whose value differs, with its kind (see module docstring).

    ``datasets`` is compared entry by entry (``datasets[1].weight``). A stream field whose
    raw value differs but whose :meth:`~LoaderConfig.stream_fields` value does not (the
    best-fit bin count under concat packing) is ``runtime``: it does not reach the batches.
    """
    stream_a, stream_b = a.stream_fields(), b.stream_fields()
    out = []
    for f in fields(LoaderConfig):
        left, right = getattr(a, f.name), getattr(b, f.name)
        if f.name == "datasets":
            for k in range(max(len(left), len(right))):
                da = left[k].__dict__ if k < len(left) else {}
                db = right[k].__dict__ if k < len(right) else {}
                for key in sorted(set(da) | set(db)):
                    if da.get(key) != db.get(key):
                        out.append({"field": f"datasets[{k}].{key}", "kind": "input",
                                    "a": _plain(da.get(key)), "b": _plain(db.get(key))})
            continue
        if left == right:
            continue
        if f.name in RUNTIME_FIELDS:
            kind = "runtime"
        elif f.name in stream_a or f.name in stream_b:  # options that enter stream_fields only when set
            kind = "stream" if stream_a.get(f.name) != stream_b.get(f.name) else "runtime"
        else:
            kind = "input"
        out.append({"field": f.name, "kind": kind, "a": _plain(left), "b": _plain(right)})
    return out


def schedule_phases(config: LoaderConfig, names: Sequence[str]) -> list[tuple[int, dict[str, Fraction]]]:
    """The effective mixture, as the loader builds it: ``(first step, {source: exact weight})``
    per phase; a step-0 entry replaces the datasets' weights. A name missing from an entry
    counts as weight 0 (the loader refuses such a config before this is reached)."""
    phases = [(0, dict(zip(names, exact_weights([d.weight for d in config.datasets]))))]
    for entry in config.schedule:
        weights = dict(zip(names, exact_weights([entry.weights.get(n, 0) for n in names])))
        if entry.step == 0:
            phases[0] = (0, weights)
        else:
            phases.append((entry.step, weights))
    return phases


def weights_at(phases: Sequence[tuple[int, dict[str, Fraction]]], step: int) -> dict[str, Fraction]:
    current = phases[0][1]
    for start, weights in phases:
        if start <= step:
            current = weights
    return current


def _weights_text(weights: dict[str, Fraction]) -> dict[str, str]:
    return {name: str(w) for name, w in weights.items()}


def schedule_difference(a: Side, b: Side) -> Optional[dict[str, Any]]:
    """The first step from which the effective mixture weights differ, with both sides'
    weights there, and every change point where they differ; None when they agree."""
    phases_a, phases_b = schedule_phases(a.config, a.source_names), schedule_phases(b.config, b.source_names)
    starts = sorted({s for s, _ in phases_a} | {s for s, _ in phases_b})
    differing = [s for s in starts if weights_at(phases_a, s) != weights_at(phases_b, s)]
    if not differing:
        return None
    first = differing[0]
    return {"from_step": first, "a": _weights_text(weights_at(phases_a, first)),
            "b": _weights_text(weights_at(phases_b, first)), "differs_at_steps": differing}


MANIFEST_FIELDS = ("source_name", "dataset_fingerprint", "seed", "num_lanes", "files_per_lane", "documents",
                   "format_version")


def manifest_differences(a: Manifest, b: Manifest) -> dict[str, Any]:
    """Fields and lane files of two manifests that differ (empty ``fields`` and file lists: equal)."""
    out: dict[str, Any] = {"fields": {}}
    for name in MANIFEST_FIELDS:
        if getattr(a, name) != getattr(b, name):
            out["fields"][name] = {"a": getattr(a, name), "b": getattr(b, name)}
    tok_a, tok_b = (a.tokenizer or {}).get("fingerprint"), (b.tokenizer or {}).get("fingerprint")
    if tok_a != tok_b:
        out["fields"]["tokenizer_fingerprint"] = {"a": tok_a, "b": tok_b}
    for name in ("schema", "rejected"):
        if getattr(a, name) != getattr(b, name):
            out["fields"][name] = {"a": getattr(a, name), "b": getattr(b, name)}
    files_a, files_b = {f.path: f for f in a.files}, {f.path: f for f in b.files}
    out["files_changed"] = sorted(p for p in files_a.keys() & files_b.keys()
                                  if (files_a[p].sha256, files_a[p].rows, files_a[p].tokens)
                                  != (files_b[p].sha256, files_b[p].rows, files_b[p].tokens))
    out["files_only_in_a"] = sorted(files_a.keys() - files_b.keys())
    out["files_only_in_b"] = sorted(files_b.keys() - files_a.keys())
    return out


def dataset_differences(a: Side, b: Side) -> list[dict[str, Any]]:
    """Per dataset position: the manifest differences (datasets only one side has are named)."""
    out = []
    for k in range(max(len(a.manifests), len(b.manifests))):
        entry: dict[str, Any] = {"dataset": k,
                                 "a": a.config.datasets[k].path if k < len(a.manifests) else None,
                                 "b": b.config.datasets[k].path if k < len(b.manifests) else None}
        if k < len(a.manifests) and k < len(b.manifests):
            entry.update(manifest_differences(a.manifests[k], b.manifests[k]))
            entry["identical"] = not (entry["fields"] or entry["files_changed"] or entry["files_only_in_a"]
                                      or entry["files_only_in_b"])
        else:
            entry["identical"] = False
        out.append(entry)
    return out


# -- the report ------------------------------------------------------------------------------
def transform_findings(config: LoaderConfig, report: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`~loader.commands.transform_culprit.find_culprit` for the sources with transforms: on
    the lane of the first differing sequence (its source first), else on lane 0."""
    manifests = [read_manifest(d.path, config.storage_options()) for d in config.datasets]
    names = [d.name or m.source_name for d, m in zip(config.datasets, manifests)]
    first = (report.get("differing_sequences") or [{}])[0]
    lane = first.get("lane") or 0
    source = (first.get("a") or {}).get("source")
    order = sorted(range(len(names)), key=lambda k: names[k] != source)
    findings = []
    for k in order:
        if config.source_transforms(k):
            found = find_culprit(config, k, manifests[k], names[k], lane)
            if found is not None:
                findings.append(found)
    return findings


def compare(a: Side, b: Side, transforms_config: Optional[LoaderConfig] = None) -> dict[str, Any]:
    """Everything ``zephon diff`` reports, as JSON-able values (``identical`` decides the exit).
    ``transforms_config``: the config two logs were made with (their transforms are tried)."""
    common = sorted(a.steps.keys() & b.steps.keys())
    differing = [s for s in common if a.steps[s].line() != b.steps[s].line()]
    only_a = sorted(a.steps.keys() - b.steps.keys())
    only_b = sorted(b.steps.keys() - a.steps.keys())
    report: dict[str, Any] = {
        "a": a.describe(), "b": b.describe(),
        "compared_steps": [common[0], common[-1]] if common else None, "num_compared_steps": len(common),
        "steps_only_in_a": only_a, "steps_only_in_b": only_b,
        "first_differing_step": differing[0] if differing else None, "num_differing_steps": len(differing),
        "identical": not differing and not only_a and not only_b,
    }
    if differing:
        first = differing[0]
        report["at_first_difference"] = {"a": _step_line(a.steps[first]), "b": _step_line(b.steps[first])}
        if a.steps[first].sequences and b.steps[first].sequences:
            report["differing_sequences"] = differing_sequences(a, b, first)
    if a.config is not None and b.config is not None:
        report["config_fields"] = config_differences(a.config, b.config)
        report["schedule"] = schedule_difference(a, b)
        report["datasets"] = dataset_differences(a, b)
    config = a.config if a.config is not None else transforms_config
    if differing and config is not None and any(config.source_transforms(k) for k in range(len(config.datasets))):
        report["transforms"] = transform_findings(config, report)
    report["causes"] = [f"transform {t['function']} (transforms[{t['position']}] of source {t['source']!r}, version "
                        f"{t['version']}, spec sha256 {t['spec_sha256'][:12]}) is not deterministic: {t['message']}"
                        for t in report.get("transforms", ())] + likely_causes(report)
    return report


def likely_causes(report: dict[str, Any]) -> list[str]:
    """Which reported differences can explain the first differing step, most direct first."""
    first = report["first_differing_step"]
    if "config_fields" not in report:
        return []
    causes = []
    stream = [d["field"] for d in report["config_fields"] if d["kind"] == "stream"]
    if stream:
        causes.append(f"stream field(s) {', '.join(stream)} differ: the batches can differ from the first step")
    for entry in report["datasets"]:
        if not entry["identical"]:
            changed = entry.get("files_changed", []) + entry.get("files_only_in_a", []) + entry.get("files_only_in_b", [])
            what = ", ".join(entry.get("fields", {})) or "lane files"
            causes.append(f"dataset {entry['dataset']} differs ({what}; {len(changed)} lane file(s)): batches differ "
                          "from the first step that reads a changed lane file")
    inputs = [d["field"] for d in report["config_fields"] if d["kind"] == "input"
              and not d["field"].startswith("schedule") and not d["field"].endswith((".path", ".weight"))]
    if inputs:
        causes.append(f"input field(s) {', '.join(inputs)} differ")
    schedule = report["schedule"]
    if schedule is not None:
        note = " (the first differing step)" if first == schedule["from_step"] else ""
        causes.append(f"the mixture schedule differs from step {schedule['from_step']}{note}")
    if first is not None and not causes:
        causes.append("only fields that never change the batches differ (or none): this is a determinism bug; "
                      "please report it with both configs and this output")
    return causes


def _short(sha: Optional[str]) -> str:
    return sha[:12] if sha else "-"


def _counts_text(counts: dict[str, int]) -> str:
    return " ".join(f"{n}={c}" for n, c in counts.items())


def render_text(report: dict[str, Any]) -> str:
    lines = []
    for label in ("a", "b"):
        side = report[label]
        span = f"steps {side['steps'][0]}..{side['steps'][1]}" if side["steps"] else "no steps"
        lines.append(f"{label.upper()}  {side['path']} ({side['kind']}, {span})")
    first = report["first_differing_step"]
    compared = report["compared_steps"]
    if compared is None:
        lines.append("no step is on both sides: nothing to compare")
    elif first is None:
        lines.append(f"identical on all {report['num_compared_steps']} common steps ({compared[0]}..{compared[1]})")
    else:
        agree = f"steps {compared[0]}..{first - 1} identical" if first > compared[0] else "no step before it compared"
        lines.append(f"first differing step: {first} ({agree}; {report['num_differing_steps']} of "
                     f"{report['num_compared_steps']} compared steps differ)")
        at = report["at_first_difference"]
        for label in ("a", "b"):
            lines.append(f"  {label.upper()} {first} {at[label]['sha256']} {_counts_text(at[label]['source_counts'])}".rstrip())
    for label in ("a", "b"):
        only = report[f"steps_only_in_{label}"]
        if only:
            lines.append(f"steps only in {label.upper()}: {len(only)} ({only[0]}..{only[-1]})")
    if "differing_sequences" in report:
        seqs = report["differing_sequences"]
        lines.append(f"sequences that differ at step {first}: {len(seqs)} (position, global index, lane: A / B)")
        for s in seqs[:TEXT_SEQUENCES_SHOWN]:
            a, b = s["a"] or {}, s["b"] or {}
            lines.append(f"  position {s['position']:>4}  index {s['global_index']:>8}  lane {s['lane']:>5}  "
                         f"A {a.get('source', '-')} {_short(a.get('sha256'))}  B {b.get('source', '-')} "
                         f"{_short(b.get('sha256'))}")
        if len(seqs) > TEXT_SEQUENCES_SHOWN:
            lines.append(f"  ... {len(seqs) - TEXT_SEQUENCES_SHOWN} more (--json lists all)")
    if "config_fields" in report:
        if report["config_fields"]:
            lines.append("config fields that differ:")
            for d in report["config_fields"]:
                lines.append(f"  {d['field']} ({d['kind']}): A {json.dumps(d['a'])}  B {json.dumps(d['b'])}")
        else:
            lines.append("config fields: identical")
        schedule = report["schedule"]
        if schedule is None:
            lines.append("mixture schedule: identical")
        else:
            lines.append(f"mixture schedule: differs from step {schedule['from_step']}: A {_counts_text(schedule['a'])}  "
                         f"B {_counts_text(schedule['b'])} (differs at change steps {schedule['differs_at_steps']})")
        for entry in report["datasets"]:
            if entry["identical"]:
                lines.append(f"dataset {entry['dataset']}: manifests identical")
                continue
            lines.append(f"dataset {entry['dataset']}: manifests differ (A {entry['a']}, B {entry['b']})")
            for name, values in entry.get("fields", {}).items():
                lines.append(f"  {name}: A {json.dumps(values['a'])}  B {json.dumps(values['b'])}")
            for key, title in (("files_changed", "lane files changed"), ("files_only_in_a", "lane files only in A"),
                               ("files_only_in_b", "lane files only in B")):
                if entry.get(key):
                    shown = entry[key][:8]
                    more = f" ... {len(entry[key]) - 8} more" if len(entry[key]) > 8 else ""
                    lines.append(f"  {title} ({len(entry[key])}): {', '.join(shown)}{more}")
    for cause in report["causes"]:
        lines.append(f"cause: {cause}")
    lines.append("result: identical" if report["identical"] else "result: different")
    return "\n".join(lines)


# -- command ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon diff",
        description="Compare two runs: two fingerprint logs, or two loader configs over --steps. "
                    "Exit 0 when identical, 1 when they differ, 2 on errors.",
    )
    parser.add_argument("a", metavar="A", help="fingerprint log (`zephon fingerprints` output) or loader config (.toml/.json)")
    parser.add_argument("b", metavar="B", help="the other log or config")
    parser.add_argument("--steps", type=_parse_steps, default=None,
                        help="START:END, steps START..END-1: required with a config (computed on 1 rank); "
                             "with two logs it limits the comparison")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--config", default=None, metavar="CONFIG",
                        help="with two logs: the loader config both runs used; when they differ, its transforms "
                             "are tried on the lane's documents and one that is not deterministic is named")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon diff``: errors are reported by :func:`loader.cli.run_command` (exit 2)."""
    return run_command("diff", argv)


def command(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        a = load_side("A", args.a, args.steps)
        b = load_side("B", args.b, args.steps)
        transforms_config = LoaderConfig.from_file(args.config) if args.config else None
    except DiffError:
        raise
    except (ZephonError, *USER_FILE_ERRORS) as exc:  # exit 2 for every error: 1 means "they differ"
        raise DiffError(f"{exc}") from exc
    try:
        report = compare(a, b, transforms_config)
    except DiffError:
        raise
    except (ZephonError, *USER_FILE_ERRORS) as exc:
        raise DiffError(f"{exc}") from exc
    print(json.dumps(report, indent=1) if args.json else render_text(report))
    return IDENTICAL_EXIT if report["identical"] else DIFFERENT_EXIT


if __name__ == "__main__":
    sys.exit(main())
