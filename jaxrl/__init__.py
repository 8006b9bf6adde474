"""jaxrl: JAX-native reinforcement-learning post-training for large language models.

Light on import on purpose: `python -m jaxrl.train` validates its config before jax is imported.
"""

__version__ = "0.1.0"
