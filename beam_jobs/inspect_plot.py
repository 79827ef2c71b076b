"""The figure of ``zephon inspect DATASET --plot FILE.png``.

Three panels: the distribution of document lengths (tokens for a pre-tokenized dataset,
read from the ``num_tokens`` column; else characters of ``text``), the tokens (or, without
tokens, documents) of every lane ``0..L-1`` from the manifest, and the dataset's records by
outcome (kept documents of the source, rejects per reason).

Lengths come from the lane files, so only they cost reads: one column of each file, and for
a large dataset a sample of files (``max_files``, evenly spaced over the manifest's files in
lane order, so the sample spans the lanes; the title says how many were read). Everything
else comes from the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loader.commands.plotting import new_figure
from loader.io.manifest import Manifest
from loader.io.storage import open_lane_file

LOG_BINS_ABOVE = 50  # max / min length ratio above which the histogram uses log-spaced bins
HISTOGRAM_BINS = 40


@dataclass(frozen=True)
class DocumentLengths:
    values: np.ndarray  # one length per document read
    unit: str  # "tokens" or "characters"
    files_read: int
    files_total: int


def sampled_files(manifest: Manifest, max_files: int) -> list:
    """``max_files`` entries evenly spaced over the files in (lane, part) order; 0 means all."""
    files = sorted(manifest.files, key=lambda f: (f.lane, f.part))
    if max_files <= 0 or len(files) <= max_files:
        return files
    picks = np.linspace(0, len(files) - 1, max_files).round().astype(int)
    return [files[k] for k in sorted(set(picks.tolist()))]


def document_lengths(dataset: str, manifest: Manifest, max_files: int) -> DocumentLengths:
    """Per-document lengths of the sampled lane files (opened as the loader opens them)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq


    column, unit = ("num_tokens", "tokens") if manifest.pretokenized else ("text", "characters")
    files = sampled_files(manifest, max_files)
    parts = []
    for entry in files:
        handle = open_lane_file(dataset, entry)
        try:
            values = pq.read_table(handle, columns=[column]).column(column)
        finally:
            handle.close()
        parts.append(np.asarray((values if unit == "tokens" else pc.utf8_length(values)).to_numpy(), dtype=np.int64))
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return DocumentLengths(values, unit, len(files), len(manifest.files))


def histogram_bins(values: np.ndarray) -> np.ndarray:
    """Log-spaced bins when lengths span more than ``LOG_BINS_ABOVE``x, else linear ones."""
    low, high = max(int(values.min()), 1), max(int(values.max()), 1)
    if high / low > LOG_BINS_ABOVE:
        return np.geomspace(low, high + 1, HISTOGRAM_BINS + 1)
    return np.linspace(low, high + 1, HISTOGRAM_BINS + 1)


def lane_totals(manifest: Manifest) -> tuple[list[int], str]:
    """Tokens per lane (pre-tokenized) or documents per lane, every lane ``0..L-1``."""
    totals = [0] * manifest.num_lanes
    for entry in manifest.files:
        totals[entry.lane] += (entry.tokens or 0) if manifest.pretokenized else entry.rows
    return totals, "tokens" if manifest.pretokenized else "documents"


def record_counts(manifest: Manifest) -> dict[str, int]:
    """Kept documents, then each reject reason that occurred (largest first)."""
    counts = {f"kept ({manifest.source_name})": manifest.documents}
    for reason, count in sorted(manifest.rejected.items(), key=lambda kv: (-kv[1], kv[0])):
        if count:
            counts[f"rejected: {reason}"] = count
    return counts


def dataset_figure(manifest: Manifest, lengths: DocumentLengths, dataset: str) -> Any:
    """The three-panel Figure (axes labelled ``lengths``, ``lanes``, ``records``)."""
    figure = new_figure(11, 8)
    axes = figure.subplot_mosaic([["lengths", "lengths"], ["lanes", "records"]], height_ratios=[1.1, 1])
    for name, ax in axes.items():
        ax.set_label(name)
    figure.suptitle(f"{manifest.source_name}: {manifest.documents:,} documents in {manifest.num_lanes} lanes "
                    f"({dataset})")

    ax = axes["lengths"]
    sample = (f"all {lengths.files_total} lane files" if lengths.files_read == lengths.files_total
              else f"{lengths.files_read} of {lengths.files_total} lane files, evenly spaced")
    log_note = ""
    if len(lengths.values):
        bins = histogram_bins(lengths.values)
        ax.hist(lengths.values, bins=bins, color="C0", edgecolor="white", linewidth=0.5)
        if bins[-1] / bins[0] > LOG_BINS_ABOVE:
            ax.set_xscale("log")
            log_note = ", log scale"
        for q, style in ((50, "--"), (99, ":")):
            value = float(np.percentile(lengths.values, q))
            ax.axvline(value, color="0.2", linestyle=style, linewidth=1.2,
                       label=f"p{q} = {value:,.0f} {lengths.unit}")
        ax.axvline(int(lengths.values.max()), color="C3", linewidth=1,
                   label=f"max = {int(lengths.values.max()):,} {lengths.unit}")
        ax.legend(fontsize=8)
    ax.set_title(f"Document length ({lengths.unit}), {len(lengths.values):,} documents from {sample}")
    ax.set_xlabel(f"document length ({lengths.unit}{log_note})")
    ax.set_ylabel("documents")
    ax.grid(alpha=0.3)

    ax = axes["lanes"]
    totals, unit = lane_totals(manifest)
    mean = sum(totals) / len(totals)
    ax.bar(range(len(totals)), totals, width=0.85 if len(totals) < 100 else 1.0, color="C2")
    ax.axhline(mean, color="0.2", linestyle="--", linewidth=1, label=f"mean {mean:,.1f}")
    empty = sum(1 for t in totals if t == 0)
    balance = f"max/mean {max(totals) / mean:.3f}" if mean else "no data"
    ax.set_title(f"{unit.capitalize()} per lane ({balance}" + (f", {empty} empty" if empty else "") + ")")
    ax.set_xlabel("lane")
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

    ax = axes["records"]
    counts = record_counts(manifest)
    labels, values = list(counts), list(counts.values())
    colors = ["C0"] + ["C3"] * (len(values) - 1)
    ax.barh(range(len(values)), values, height=0.6, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    log_scale = min(values) > 0 and max(values) / min(values) > 100
    if log_scale:
        ax.set_xscale("log")  # a handful of rejects next to millions of documents
    for k, value in enumerate(values):
        ax.annotate(f"{value:,}", xy=(value, k), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    rejected = sum(values[1:])
    total = sum(values)
    ax.set_title(f"Records by outcome ({rejected:,} rejected, {rejected / total:.2%})" if total else "Records")
    ax.set_xlabel("records (log scale)" if log_scale else "records")
    ax.margins(x=0.15)
    ax.grid(alpha=0.3, axis="x")
    return figure
