"""What the JAX tests share: value-and-gradient comparisons."""

import numpy as np


def assert_close(got, expected, atol=1e-5, what=""):
    """Arrays (or tensors, or None on both sides) equal within ``atol``."""
    if expected is None:
        assert got is None, what
        return
    expected = expected.detach().numpy() if hasattr(expected, "detach") else np.asarray(expected)
    np.testing.assert_allclose(np.asarray(got), expected, atol=atol, err_msg=what)
