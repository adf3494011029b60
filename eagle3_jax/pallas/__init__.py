"""GPU kernels, each beside a plain-jnp reference of the same signature. Imports only eagle3_jax.formats."""
