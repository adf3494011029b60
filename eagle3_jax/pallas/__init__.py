"""GPU kernels, each beside a plain-jnp reference of the same signature. Imports nothing of the package."""
