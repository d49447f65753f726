"""jdist's private modules; the public API is re-exported from :mod:`jdist`.

Importing any of them first checks that the installed JAX is a release jdist is tested on
(`jax_version`), before any module reads a JAX program.
"""

import jax as _jax

from jdist._src import jax_version as _jax_version

_jax_version.check(_jax.__version__)
