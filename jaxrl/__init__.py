"""jaxrl: JAX-native RL for reasoning language models."""
