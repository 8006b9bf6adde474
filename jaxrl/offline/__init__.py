"""The offline trainers on the RL trainer's roles and loop: supervised fine-tuning (``python -m jaxrl.sft``) and
DPO from preference pairs (``python -m jaxrl.dpo``).

Modules: :mod:`~jaxrl.offline.cli` (the two commands: parse, validate before jax, map errors to exit codes) ·
:mod:`~jaxrl.offline.build` (construction: lock, resume discovery, mesh, data, model, role, logger, store) ·
:mod:`~jaxrl.offline.trainer` (the step, validation, checkpoint fingerprint, export). The roles are
:mod:`jaxrl.workers.sft` and :mod:`jaxrl.workers.preference`, the data :mod:`jaxrl.data.sft`,
:mod:`jaxrl.data.preference` and :mod:`jaxrl.data.offline`, the losses :mod:`jaxrl.algorithms.preference`.
"""
