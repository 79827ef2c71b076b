"""A loader's plan: what its config and datasets make of it before anything is read.

:func:`plan_loader` reads the manifests and the tokenizer, checks that the sources fit
together (names, lane counts, tokenizers, schedule, chat lengths, transforms) and returns a
frozen :class:`LoaderPlan`: the topology, the features of every sequence, the lanes' spec
(:class:`~loader.stages.lane.LaneSpec`, what a worker process is handed). A bad config or
dataset fails here, in the trainer's process, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loader.config import LoaderConfig
from loader.errors import ManifestError
from loader.io.blocks import TokenFormat
from loader.io.manifest import Manifest, read_manifest
from loader.io.storage import StorageOptions
from loader.kinds.base import source_plan, source_plans
from loader.order.mixing import MixingSchedule, MixturePhase, exact_weights
from loader.order.ordering import Topology
from loader.stages.features import FEATURES
from loader.stages.lane import LaneSpec, SourceSpec
from loader.stages.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    load_tokenizer,
    resolve_special_token,
    tokenizer_fingerprint,
)
from loader.transforms.chain import TransformChain
from loader.transforms.conversations import ChatTransforms
from loader.transforms.spec import TransformSpec


@dataclass(frozen=True)
class LoaderPlan:
    """What :func:`plan_loader` made of a config (one rank's; only ``topology`` depends on the rank)."""

    storage_options: StorageOptions
    manifests: tuple[Manifest, ...]
    source_names: tuple[str, ...]
    num_lanes: int
    topology: Topology
    tokenizer_fingerprint: str
    phases: tuple[MixturePhase, ...]  # the config's mixture schedule (a restore may adopt a recorded one)
    features: tuple[str, ...]  # per-token features of every sequence (loader.stages.features)
    image_options: Any  # a loader.vision.block.ImageOptions for image sources, else None
    token_format: TokenFormat
    pad_id: int
    token_mixing: bool  # mixing_unit "token" with more than one source
    chat_reject_reasons: tuple  # the online chat reject reasons the batches count
    source_transforms: tuple[tuple[TransformSpec, ...], ...]  # per source, resolved
    spec: LaneSpec  # the lanes' spec, handed to worker processes


def plan_loader(config: LoaderConfig, *, rank: int, world_size: int) -> LoaderPlan:
    """The plan of data-parallel rank ``rank`` of ``world_size`` for ``config`` (reads the
    manifests and the tokenizer; raises :class:`~loader.errors.ManifestError` or
    :class:`~loader.errors.ConfigError` naming the dataset or field at fault)."""
    storage_options = config.storage_options()
    manifests = [read_manifest(d.path, storage_options) for d in config.datasets]
    source_names = [d.name or m.source_name for d, m in zip(config.datasets, manifests)]
    if len(set(source_names)) != len(source_names):
        raise ManifestError(f"datasets have duplicate source names {source_names}; give each a distinct 'name'")
    lane_counts = {n: m.num_lanes for n, m in zip(source_names, manifests)}
    if len(set(lane_counts.values())) != 1:
        raise ManifestError(
            f"all datasets of a mix must have the same lane count L (got {lane_counts}); re-shard "
            "the odd ones with `zephon shard ... --num-lanes N` using one N for every source"
        )
    num_lanes = next(iter(lane_counts.values()))
    topology = Topology(
        num_lanes=num_lanes, global_batch_size=config.global_batch_size,
        micro_batch_size=config.micro_batch_size, world_size=world_size, rank=rank,
    )
    tokenizer = load_tokenizer(config.tokenizer, storage_options)
    fingerprint = tokenizer_fingerprint(tokenizer)
    for name, manifest in zip(source_names, manifests):
        if manifest.pretokenized and manifest.tokenizer.get("fingerprint") != fingerprint:
            raise ManifestError(
                f"dataset {name!r} was pre-tokenized with a different tokenizer (fingerprint "
                f"{manifest.tokenizer.get('fingerprint', '?')[:12]}...) than config 'tokenizer' "
                f"{config.tokenizer} ({fingerprint[:12]}...); use the same tokenizer "
                "or re-shard without --tokenizer"
            )
    eos_id = resolve_special_token(tokenizer, config.eos_token, EOS_CANDIDATES, "eos_token")
    bos_id = resolve_special_token(tokenizer, config.bos_token, BOS_CANDIDATES, "bos_token") if config.add_bos else None
    pad_id = eos_id if config.pad_token is None else resolve_special_token(tokenizer, config.pad_token, (), "pad_token")
    phases = initial_phases(config, source_names)
    needs_text = any(not m.pretokenized for m in manifests)
    # Per-token features of this loader's sequences (loader.stages.features): a column feature
    # when any pre-tokenized source's lane files hold its column, token_sources under
    # token mixing. Every sequence, and so every micro-batch, holds all of them.
    columns = {c.get("name") for m in manifests if m.pretokenized for c in m.schema}
    if any(m.online_chat for m in manifests):
        columns.add("loss_mask")  # made online by the chat blocks (loader.chat.block)
    # Image sources (loader.vision): placeholders, loss_mask 0 on them, image_ref per image.
    images = source_plan("images").options
    image_options = None if images is None else images(config, manifests, source_names, tokenizer)
    if image_options is not None:
        columns.add("loss_mask")
    token_mixing = config.mixing_unit == "token" and len(manifests) > 1
    features = tuple(name for name, f in FEATURES.items()
                     if (f.column is not None and f.column in columns)
                     or (name == "token_sources" and token_mixing)
                     or (name == "image_ref" and image_options is not None))
    token_format = TokenFormat(bos_id=bos_id, eos_id=eos_id if config.add_eos else None)
    check_chat = source_plan("chat").rejects
    chat_reject_reasons = () if check_chat is None else check_chat(
        manifests, source_names, tokenizer, seq_len=config.seq_len, packing=config.packing,
        wrap_tokens=token_format.extra, overlong=config.overlong)
    # Transforms (loader.transforms): imported and checked here, not first in a worker.
    source_transforms = resolved_transforms(config, source_names, manifests, features, token_format.extra)
    spec = LaneSpec(
        sources=tuple(
            SourceSpec(name, d.path, m.to_json(), d.exhaustion, d.max_epochs, transforms)
            for name, d, m, transforms in zip(source_names, config.datasets, manifests, source_transforms)
        ),
        seed=config.seed,
        seq_len=config.seq_len,
        packing=config.packing,
        best_fit_open_bins=config.best_fit_open_bins,
        token_format=token_format,
        pad_id=pad_id,
        tokenizer_json=tokenizer.to_str() if needs_text else None,
        storage_options=storage_options,
        schedule=MixingSchedule(phases, config.global_batch_size, config.seed),
        global_batch_size=config.global_batch_size,
        mixing_unit=config.mixing_unit,
        read_ahead=config.read_ahead,
        read_ahead_threads=config.read_ahead_threads,
        features=features,
        images=image_options,
        packing_window=config.packing_window,
        fill_tails=config.fills_tails,
        overlong=config.overlong,
    )
    return LoaderPlan(
        storage_options=storage_options, manifests=tuple(manifests), source_names=tuple(source_names),
        num_lanes=num_lanes, topology=topology, tokenizer_fingerprint=fingerprint, phases=tuple(phases),
        features=features, image_options=image_options, token_format=token_format, pad_id=pad_id,
        token_mixing=token_mixing, chat_reject_reasons=chat_reject_reasons,
        source_transforms=tuple(source_transforms), spec=spec,
    )


def resolved_transforms(config: LoaderConfig, source_names, manifests, features: tuple[str, ...],
                        wrap_tokens: int) -> list[tuple]:
    """Each source's transforms, resolved to their stage and imported and checked now (not first
    in a worker): the configured ones, then ``overlong``'s (:func:`overlong_transforms`)."""
    resolved = []
    for k, (name, manifest) in enumerate(zip(source_names, manifests)):
        online_chat = manifest.online_chat  # "any" functions take the tokens stage there (after the render)
        specs = tuple(spec.resolved(manifest.pretokenized or online_chat)
                      for spec in config.source_transforms(k) + overlong_transforms(config, manifest, wrap_tokens))
        if specs and online_chat:
            ChatTransforms(specs, seed=config.seed, source=name)  # imports each function, checks its stage
        elif specs:
            feature_names = [f for f in features if FEATURES[f].column in
                             {c.get("name") for c in manifest.schema}]
            TransformChain(specs, seed=config.seed, source=name, pretokenized=manifest.pretokenized,
                           feature_names=feature_names)  # imports each function, checks its stage
        resolved.append(specs)
    return resolved


def overlong_transforms(config: LoaderConfig, manifest: Manifest, wrap_tokens: int) -> tuple[TransformSpec, ...]:
    """``overlong`` "drop" / "truncate": the transform that makes every conversation of a chat
    source fit one best_fit sequence, after the configured ones (its drops are counted like
    theirs), where the recorded longest may not fit. Offline and online alike: an online
    source is then encoded with the job's bound only (loader.chat.block.effective_max_tokens)."""
    if config.overlong == "refuse" or not any(
            plan.overflows(manifest, seq_len=config.seq_len, packing=config.packing, wrap_tokens=wrap_tokens)
            for plan in source_plans() if plan.overflows is not None):
        return ()
    fit = config.seq_len - wrap_tokens
    if config.overlong == "drop":
        return (TransformSpec("length_tokens", {"max": fit}),)
    return (TransformSpec("truncate_turns", {"max_tokens": fit}),)


def initial_phases(config: LoaderConfig, source_names) -> list[MixturePhase]:
    """The mixture of step 0 (the datasets' weights) and the config's schedule after it."""
    base = MixturePhase(0, exact_weights([d.weight for d in config.datasets]))
    phases = [base]
    for entry in config.schedule:
        unknown = sorted(set(entry.weights) - set(source_names))
        missing = [n for n in source_names if n not in entry.weights]
        if unknown or missing:
            raise ManifestError(
                f"schedule entry at step {entry.step}: weights must name every source exactly "
                f"(sources: {source_names}; unknown {unknown}, missing {missing})"
            )
        weights = exact_weights([entry.weights[n] for n in source_names])
        if entry.step == 0:
            phases[0] = MixturePhase(0, weights)
        else:
            phases.append(MixturePhase(entry.step, weights))
    return phases
