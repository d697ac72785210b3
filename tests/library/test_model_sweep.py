"""Every causal LM type transformers ships, built tiny (tests/helpers/model_sweep.py): its log-probs through logitless's
head equal its own forward's, or it is refused in one line, or it does not build here. Marked ``sweep``, which
`make test` leaves out (a few minutes); docs/models.md has the counts of its last run:

    PYTHONPATH=src python -m pytest -q -m sweep tests/library/test_model_sweep.py
"""

import pytest
from model_sweep import OUTCOMES, model_types, outcome

from logitless.hf_probe import CHECKED_CLASSES

pytestmark = pytest.mark.sweep


@pytest.mark.parametrize("model_type", model_types())
def test_a_causal_lm_is_equal_to_its_own_forward_refused_in_one_line_or_not_built(model_type):
    """Never a different number; and `CHECKED_CLASSES`, which a sharded model's class must be in, is exactly the
    classes found equal."""
    result = outcome(model_type)
    assert result.kind in OUTCOMES, result
    if result.kind != "does not build here":
        listed = result.model_class in CHECKED_CLASSES
        assert listed == (result.kind == "equal"), (f"{result.model_class} ({model_type}, {result.kind}) must "
                                                    f"{'not ' if listed else ''}be in hf_probe.CHECKED_CLASSES")
