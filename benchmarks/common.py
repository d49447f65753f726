"""What the benchmarks share: eight simulated CPU devices and a plain-JAX MLP.

Import it before anything that imports jax: it requests the simulated devices, which JAX reads
when its backend starts (a device count the caller already set in ``XLA_FLAGS`` wins).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def init_mlp(key, layers):
    """He-initialised dense layers ``w0, b0, w1, ...`` for the sizes in ``layers``."""
    params = {}
    for i, (fan_in, fan_out) in enumerate(zip(layers[:-1], layers[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (fan_in, fan_out)) * jnp.sqrt(2.0 / fan_in)
        params[f"b{i}"] = jnp.zeros((fan_out,))
    return params


def mlp_logits(params, x):
    """The MLP of `init_mlp`: dense layers with ReLU between them."""
    depth = len(params) // 2
    for i in range(depth):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < depth - 1:
            x = jax.nn.relu(x)
    return x
