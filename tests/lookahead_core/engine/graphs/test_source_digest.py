"""A package's key digests the traced code as it runs: an edit of a docstring or a comment in a
traced module keeps every package; an edit of the code names new ones."""
import inspect

from lookahead_core.engine.graphs import step
from lookahead_core.engine.graphs.source_digest import code_digest

SOURCE = inspect.getsource(step.decode_step)


def test_a_docstring_or_comment_edit_keeps_the_key():
    edited = SOURCE.replace('"""(logits [B, T, V], greedy next token [B, T]) of rows [0, B), each token written at its column."""',
                            '"""Reworded: the step\'s logits and greedy tokens."""  # and a comment')
    assert edited != SOURCE
    assert code_digest(edited) == code_digest(SOURCE)
    assert code_digest(SOURCE.replace("\n    cache =", "\n    # why the cache comes first\n    cache =")) == code_digest(SOURCE)


def test_an_edit_of_the_code_changes_the_key():
    assert code_digest(SOURCE.replace("argmax(dim=-1)", "argmax(dim=-1, keepdim=False)")) != code_digest(SOURCE)
    assert code_digest(SOURCE.replace("use_cache=True", "use_cache=False")) != code_digest(SOURCE)


def test_the_graphs_source_covers_the_traced_modules():
    from lookahead_core.engine.graphs import attention, slot_cache
    from lookahead_core.engine.graphs.source_digest import source_digest
    from lookahead_core.engine.runner import fused_projections
    from lookahead_core.engine.runner.weights import PackedLinear

    assert step.GRAPH_SOURCE == source_digest(step.decode_step, step.prefill_step, step.StepModule, slot_cache,
                                              attention, PackedLinear, fused_projections)
    assert source_digest(step.decode_step) != source_digest(step.prefill_step)
