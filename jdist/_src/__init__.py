"""jdist's private modules; the public API is re-exported from :mod:`jdist`.

Importing any of them first checks that the installed JAX is a release jdist is tested on
(`jax_version`), before any module reads a JAX program, then imports the wings the core calls
through `base` (each registers itself): the core imports none of them.
"""

import jax as _jax

from jdist._src import jax_version as _jax_version

_jax_version.check(_jax.__version__)

from jdist._src import input as _input  # noqa: E402,F401  (registers `base.InputWing`)
from jdist._src import reduce as _reduce  # noqa: E402,F401  (registers `base.ReduceWing`)
from jdist._src import run as _run  # noqa: E402,F401  (registers `base.RunWing`)
