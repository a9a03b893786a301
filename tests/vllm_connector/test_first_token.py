"""The prefill's first token put in front of a decode request's first output."""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

from hybrid_pd.connector.vllm.first_token import FirstTokens, install


def _outputs(*outs: EngineCoreOutput) -> dict[int, EngineCoreOutputs]:
    return {0: EngineCoreOutputs(outputs=list(outs))}


def test_owed_tokens_go_in_front_of_the_first_output_only():
    owed = FirstTokens()
    owed.owe("a", 7)
    owed.owe("b", 9)
    step = _outputs(EngineCoreOutput("a", [11]), EngineCoreOutput("c", [5]))
    owed.pay(step)
    assert [o.new_token_ids for o in step[0].outputs] == [[7, 11], [5]]
    assert len(owed) == 1  # b has had no output yet
    step = _outputs(EngineCoreOutput("a", [12]), EngineCoreOutput("b", [13, 14]))
    owed.pay(step)
    assert [o.new_token_ids for o in step[0].outputs] == [[12], [9, 13, 14]]
    assert len(owed) == 0


def test_requests_that_end_without_a_token_owe_nothing():
    owed = FirstTokens()
    owed.owe("err", 3)
    owed.owe("gone", 4)
    step = _outputs(EngineCoreOutput("err", [], finish_reason=FinishReason.ERROR))
    owed.pay(step)
    assert step[0].outputs[0].new_token_ids == []
    owed.ended("gone")  # aborted before any output
    owed.pay(_outputs())
    owed.pay(_outputs(EngineCoreOutput("x", [1])))
    assert len(owed) == 0


def test_install_wraps_the_scheduler_once():
    install()
    wrapped = Scheduler.update_from_output
    install()
    assert Scheduler.update_from_output is wrapped
    assert wrapped.__wrapped__ is not wrapped
