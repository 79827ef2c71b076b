"""``zephon inspect DATASET [--json]``: a summary of a sharded dataset from its manifest.

Reads only ``manifest.json`` (through :func:`loader.io.manifest.read_manifest`, so local paths
and ``gs://`` both work, and a manifest whose fingerprint does not match its content is
refused). Nothing here imports Beam, so the command starts fast. ``--plot FILE.png`` also
reads one column (document lengths) of the lane files, or of a sample of them
(``--plot-max-files``), and draws :mod:`beam_jobs.inspect_plot`'s figure.

The per-lane balance counts every lane ``0..L-1``, including lanes that received no
documents (they count as 0 and are reported as ``empty_lanes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Optional, Sequence

from beam_jobs.inspect_plot import dataset_figure, document_lengths
from loader.cli import run_command
from loader.commands.plotting import new_figure, save_figure
from loader.io.manifest import Manifest, read_manifest

PLOT_MAX_FILES = 64  # lane files read for the length histogram by default (a column each)


def _spread(per_lane: list[int]) -> dict[str, Any]:
    mean = sum(per_lane) / len(per_lane) if per_lane else 0.0
    return {
        "min": min(per_lane, default=0),
        "median": statistics.median(per_lane) if per_lane else 0,
        "max": max(per_lane, default=0),
        "mean": round(mean, 3),
        "max_over_mean": round(max(per_lane) / mean, 4) if mean else None,
    }


def summarize(manifest: Manifest, dataset: str) -> dict[str, Any]:
    """Everything ``inspect`` prints, as JSON-able values."""
    documents_per_lane = [0] * manifest.num_lanes
    tokens_per_lane = [0] * manifest.num_lanes
    for entry in manifest.files:
        documents_per_lane[entry.lane] += entry.rows
        tokens_per_lane[entry.lane] += entry.tokens or 0
    rejected_total = sum(manifest.rejected.values())
    records = manifest.documents + rejected_total
    return {
        "dataset": dataset,
        "source_name": manifest.source_name,
        "dataset_fingerprint": manifest.dataset_fingerprint or manifest.compute_fingerprint(),
        "format_version": manifest.format_version,
        "seed": manifest.seed,
        "num_lanes": manifest.num_lanes,
        "files_per_lane": manifest.files_per_lane,
        "files": len(manifest.files),
        "documents": manifest.documents,
        "pretokenized": manifest.pretokenized,
        "tokens": manifest.total_tokens,
        "tokenizer": manifest.tokenizer,
        "bytes": sum(f.bytes for f in manifest.files),
        "row_groups": sum(f.row_groups for f in manifest.files),
        "empty_lanes": sum(1 for n in documents_per_lane if n == 0),
        "lane_documents": _spread(documents_per_lane),
        "lane_tokens": _spread(tokens_per_lane) if manifest.pretokenized else None,
        "rejected": {reason: count for reason, count in sorted(manifest.rejected.items()) if count},
        "rejected_total": rejected_total,
        "rejected_fraction": round(rejected_total / records, 6) if records else 0.0,
        "schema": manifest.schema,
        **({"images": manifest.images.to_dict()} if manifest.images is not None else {}),  # image datasets only
    }


def _size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _balance_line(spread: dict[str, Any]) -> str:
    ratio = spread["max_over_mean"]
    return (f"min {spread['min']:,} / median {spread['median']:,} / max {spread['max']:,}"
            f" (max/mean {ratio:.3f})" if ratio is not None else "no data")


def render_text(summary: dict[str, Any]) -> str:
    tokenizer = summary["tokenizer"]
    lines = [
        f"dataset        {summary['dataset']}",
        f"source         {summary['source_name']}",
        f"fingerprint    {summary['dataset_fingerprint']}",
        f"layout         format v{summary['format_version']}, seed {summary['seed']}, "
        f"{summary['num_lanes']} lanes x {summary['files_per_lane']} file(s) per lane, "
        f"{summary['files']} files, {summary['row_groups']} row groups",
        f"documents      {summary['documents']:,}",
    ]
    if summary["pretokenized"]:
        lines.append(f"tokens         {summary['tokens']:,} (pre-tokenized; tokenizer "
                     f"{tokenizer['fingerprint'][:16]}..., vocab {tokenizer.get('vocab_size')})")
    else:
        lines.append("tokens         not pre-tokenized (the loader tokenizes online)")
    if summary.get("images") is not None:
        images = summary["images"]
        policy = images["policy"]
        lines.append(f"images         {images['images']:,} (visual tokens: " + (
            f"{policy['kind']} policy {images['policy_fingerprint'][:16]}...)" if policy else "not counted offline)"))
    lines.append(f"bytes          {_size(summary['bytes'])} in lane files")
    lines.append(f"lane balance   documents: {_balance_line(summary['lane_documents'])}")
    if summary["lane_tokens"] is not None:
        lines.append(f"               tokens:    {_balance_line(summary['lane_tokens'])}")
    if summary["empty_lanes"]:
        lines.append(f"               {summary['empty_lanes']} lane(s) hold no documents")
    if summary["rejected_total"]:
        by_reason = ", ".join(f"{reason} {count:,}" for reason, count in summary["rejected"].items())
        lines.append(f"rejected       {summary['rejected_total']:,} "
                     f"({summary['rejected_fraction']:.2%} of records): {by_reason}; see _rejected/")
    else:
        lines.append("rejected       none")
    lines.append("schema         " + ", ".join(f"{c['name']}:{c['type']}" for c in summary["schema"]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zephon inspect",
                                     description="Summarise a sharded Zephon dataset from its manifest.json.")
    parser.add_argument("dataset", metavar="DATASET", help="dataset directory (local, gs:// or s3://)")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON (includes dataset_fingerprint; default: text)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also write a figure: document-length distribution (tokens if pre-tokenized, else "
                             "characters), tokens (or documents) per lane, records kept and rejected by reason")
    parser.add_argument("--plot-max-files", metavar="N", type=int, default=PLOT_MAX_FILES,
                        help=f"read document lengths from at most N lane files, evenly spaced over the lanes "
                             f"(default {PLOT_MAX_FILES}; 0 reads every file)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon inspect``: errors (a missing or tampered manifest) are reported by :func:`loader.cli.run_command`."""
    return run_command("inspect", argv)


def command(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.plot_max_files < 0:
        parser.error(f"--plot-max-files must be >= 0 (0 reads every file; got {args.plot_max_files})")
    manifest = read_manifest(args.dataset)  # ManifestError / OSError: one line, exit 1
    summary = summarize(manifest, args.dataset)
    if args.plot is not None:
        new_figure(1, 1)  # matplotlib missing: say so before reading any lane file
        lengths = document_lengths(args.dataset, manifest, args.plot_max_files)
        save_figure(dataset_figure(manifest, lengths, args.dataset), args.plot)
        summary["plot"] = {"path": args.plot, "length_unit": lengths.unit, "documents_read": len(lengths.values),
                           "files_read": lengths.files_read}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(render_text(summary))
        if args.plot is not None:
            plot = summary["plot"]
            print(f"plot           {plot['path']} (lengths in {plot['length_unit']} of {plot['documents_read']:,} "
                  f"documents from {plot['files_read']} of {summary['files']} lane files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
