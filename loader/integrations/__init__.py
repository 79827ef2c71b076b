"""Adapters that plug a :class:`~loader.pipeline.ZephonLoader` into trainer frameworks.

Each is one module with its framework as an optional dependency
(``pip install "zephon-loader[integrations]"``), imported only by the code that uses it:

- :mod:`loader.integrations.hf`: ``ZephonTrainer``, a Hugging Face ``transformers.Trainer``;
- :mod:`loader.integrations.lightning`: ``ZephonLightning``, a PyTorch Lightning callback and
  train iterable;
- :mod:`loader.integrations.titan`: ``ZephonTitanDataLoader``, a torchtitan-style loader for
  ``torch.distributed.checkpoint`` with tensor/pipeline parallelism;
- :mod:`loader.integrations.torch_data`: plain PyTorch, ``ZephonIterableDataset`` for a
  ``torch.utils.data.DataLoader`` and ``LoaderStateful`` for ``torch.distributed.checkpoint``;
- :mod:`loader.integrations.stateful_dataloader`: torchdata's ``StatefulDataLoader`` and
  merging its per-rank states (this module was ``loader.integrations.torchdata``);
- :mod:`loader.integrations.framework_paths`: no public names; the checks by which the loader
  itself refuses a framework that drives it without these classes in a way that would train
  on other data (naming the class to use).
"""

# Module -> the public names it defines (the reference pages are generated from this table).
MODULES = {
    "hf": ("ZephonTrainer", "ZephonCheckpointCallback", "read_checkpoint_state", "HFIntegrationError"),
    "lightning": ("ZephonLightning", "ZephonTrainIterable", "LightningIntegrationError"),
    "titan": ("ZephonTitanDataLoader",),
    "torch_data": ("ZephonIterableDataset", "LoaderStateful"),
    "stateful_dataloader": ("zephon_stateful_dataloader", "merge_dataloader_states", "zephon_state_of"),
}
