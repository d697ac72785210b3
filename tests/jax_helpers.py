"""What the JAX tests share: the PyTorch ops called with the JAX ops' keyword spellings, and value-and-gradient
comparisons."""

import inspect

import numpy as np

# the keywords as the JAX ops spell them -> the spelling of a PyTorch op whose signature does not have them
PYTORCH_SPELLINGS = {"old_log_probs": "old_logprobs", "ref_log_probs": "ref_logprobs",
                     "return_token_entropy": "return_entropy"}


def pytorch(op, *args, **keywords):
    """``op`` (a PyTorch op of logitless) called with the keywords as the JAX ops spell them, each passed under the
    name ``op``'s signature has."""
    taken = inspect.signature(op).parameters
    return op(*args, **{PYTORCH_SPELLINGS.get(name, name) if name not in taken else name: value
                        for name, value in keywords.items()})


def assert_close(got, expected, atol=1e-5, what=""):
    """Arrays (or tensors, or None on both sides) equal within ``atol``."""
    if expected is None:
        assert got is None, what
        return
    expected = expected.detach().numpy() if hasattr(expected, "detach") else np.asarray(expected)
    np.testing.assert_allclose(np.asarray(got), expected, atol=atol, err_msg=what)
