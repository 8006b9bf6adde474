"""The hybrid controller (HybridFlow's single controller over worker groups): ``actor_rollout_ref.rollout.nnodes``
>= 1 with ``trainer.launcher=ray``.

The Ray driver runs :class:`jaxrl.trainer.Trainer` itself; the roles live in worker groups, each a JAX world of its
own on its own resource pool:

* :mod:`jaxrl.hybrid.groups`: :class:`WorkerGroup` (one Ray actor per host of a pool, one-to-all calls, a lost member
  noticed within seconds) and :class:`GroupFailure`;
* :mod:`jaxrl.hybrid.worker`: what runs in the groups: :class:`TrainWorker` (actor, reference, critic on the train
  mesh) and :class:`RolloutWorker` (the engine on the rollout mesh, weights loaded through its translator);
* :mod:`jaxrl.hybrid.proxies`: the driver's stand-ins for the roles, the engine and the weight sync (each call an
  RPC; weights through Ray's object store);
* :mod:`jaxrl.hybrid.controller`: :func:`run_hybrid` (``python -m jaxrl.train`` calls it), :func:`build_hybrid`,
  :func:`hybrid_run` (build + teardown), :func:`start_groups`.

Ray is imported only inside the functions that need it (the ``ray`` extra); ``jaxrl.train`` imports this package
only once the config chose a rollout pool.
"""
