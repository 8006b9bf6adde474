"""Multi-turn rollouts with tools (verl's ``actor_rollout_ref.rollout.multi_turn``): the Hermes tool-call parser,
tools (a sandboxed Python interpreter, a calculator, user classes), verl's tool-config YAML, the environment
interface and the loop that drives a :class:`jaxrl.rollout.base.RolloutEngine`. Never imports the trainer or the
roles."""
