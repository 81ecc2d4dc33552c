"""What ranks agree on when some of them fail (toolkit.distributed.agreement.verdict: every rank's note in, the
error this rank raises out), the streaming refusals that only some ranks reach (their words), and the one train
--check can make before launch. The ranks themselves: tests/distributed/test_rank_agreement.py."""

import json

import pytest

from tests.configs import ds_config, write_config
from toolkit.distributed.agreement import agree, spans, verdict
from toolkit.distributed.topology import Topology
from toolkit.errors import ConfigError, RankFailed, UnusableInput

NO_ROWS = "dp rank 1 has none"


def test_a_refusal_on_one_rank_is_every_ranks_with_its_class_and_words():
    every = [None, ("unusable", NO_ROWS), None, None]
    for mine in (None, UnusableInput(NO_ROWS)):
        error = verdict(every, "reading", mine)
        assert type(error) is UnusableInput and str(error) == f"rank 1 of 4: {NO_ROWS}"


def test_several_refusals_are_one_line_naming_the_ranks_and_the_other_words():
    every = [None, ("refusal", "a"), ("refusal", "a"), ("refusal", "b"), ("refusal", "c"), ("refusal", "d")]
    line = str(verdict(every, "reading"))
    assert line == "ranks 1-5 of 6: a; also: b; and 2 more refusal(s)"
    assert "\n" not in line and type(verdict(every, "reading")) is ConfigError
    assert str(verdict([("refusal", "x")] * 3, "reading")) == "x"  # every rank alike: its words alone
    assert str(verdict([("refusal", "bad row"), None], "preparing --data", name_ranks=False)) == "bad row"  # for all


def test_a_failure_that_is_no_refusal_is_its_ranks_traceback_and_one_line_elsewhere():
    every = [None, ("OSError", "[Errno 28] No space left on device")]
    other = verdict(every, "writing the run's record")
    assert isinstance(other, RankFailed) and isinstance(other, ConfigError)  # one line from toolkit.cli.main
    assert str(other) == ("rank 1 of 2 failed while writing the run's record: OSError: [Errno 28] No space left on "
                          "device (its traceback is in rank 1's output)")
    mine = OSError(28, "No space left on device")
    assert verdict(every, "writing", mine) is mine  # its own traceback
    refused = verdict([("refusal", "bad row"), ("OSError", "disk")], "reading", mine)
    assert refused is mine and "other ranks refused too: rank 0 of 2: bad row" in mine.__notes__[0]
    assert str(verdict([("refusal", "bad row"), ("OSError", "disk")], "reading")) == "rank 0 of 2: bad row"


def test_an_agreement_inside_another_keeps_the_first_report():
    """check_shared_out agrees inside the set-up's agreement: rank 0's own error, the others' report of it."""
    report = "rank 0 of 2 failed while writing into out: PermissionError: denied (its traceback is in rank 0's output)"
    every = [("PermissionError", "denied"), ("elsewhere", report)]
    mine = PermissionError("denied")
    assert verdict(every, "checking", mine) is mine and not getattr(mine, "__notes__", None)
    assert str(verdict([("elsewhere", report)] * 2, "checking")) == report


def test_without_a_process_group_the_error_is_raised_as_it_is():
    with pytest.raises(UnusableInput, match="alone"):
        with agree("reading"):
            raise UnusableInput("alone")
    with agree("reading"):
        pass


def test_ranks_read_as_runs():
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and spans([3]) == "3"


def saved_tag(tmp_path, positions: dict):
    """A --streaming checkpoint's tag holding each rank's stream position {rank: (dp, dp_rank)}."""
    tag = tmp_path / "global_step2"
    tag.mkdir()
    for rank, (dp, dp_rank) in positions.items():
        (tag / f"data_position_{rank}.json").write_text(json.dumps({"pass": 0, "docs": 0, "rows": 4, "dp": dp,
                                                                     "dp_rank": dp_rank}))
    return tag


def test_a_streaming_resume_on_more_stages_finds_each_replicas_place(tmp_path):
    """pp 1 -> pp 2: rank 1 saved no position of its own (once refused on rank 1 alone, then hung the others): a
    place is its replica's, so both stages of the replica resume from rank 0's."""
    from toolkit.train.job import stream_position

    tag = saved_tag(tmp_path, {0: (1, 0)})
    saved = {"dp": 1, "pp": 1, "tp": 1, "sp": 1}
    assert [stream_position(tag, saved, Topology(2, pp=2), r)["rows"] for r in (0, 1)] == [4, 4]


def test_a_streaming_resume_that_keeps_dp_but_not_the_ranks_resumes_and_another_dp_is_refused(tmp_path):
    """dp 2 x sp 2 -> dp 2 x sp 1: rank 1 saved dp rank 0's position (the message said "belongs to dp rank 0 of 2"
    with dp unchanged); each replica's place is found by replica. dp 2 -> dp 1 is refused, naming both layouts."""
    from toolkit.train.job import stream_position

    tag = saved_tag(tmp_path, {0: (2, 0), 1: (2, 0), 2: (2, 1), 3: (2, 1)})
    saved = {"dp": 2, "pp": 1, "tp": 1, "sp": 2}
    assert [stream_position(tag, saved, Topology(2), r)["dp_rank"] for r in (0, 1)] == [0, 1]
    with pytest.raises(UnusableInput) as refused:
        stream_position(tag, saved, Topology(1), 0)
    assert ("global_step2 was saved on dp 2 x pp 1 x tp 1 x sp 2, 4 ranks; a --streaming run's place in its stream is "
            "kept per data-parallel replica (rows i % dp), so it resumes with dp 2, not 1") in str(refused.value)


def test_check_refuses_a_stream_with_fewer_documents_than_dp(tmp_path):
    """Known before launch: the first dp documents are read (with the ranks' reader), no more."""
    from toolkit.train.runner import TrainArgs, check

    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    cfg = write_config(tmp_path / "ds.json", ds_config(1, 1))
    args = TrainArgs(model="tiny-gpt2", data=str(data), config=str(cfg), out=str(tmp_path / "run"), streaming=True,
                     steps=2, eval_fraction=0.0)
    check(args, 3)
    with pytest.raises(UnusableInput) as refused:
        check(args, 4)
    assert str(refused.value) == (f"--streaming: --data {data} has 3 document(s) and dp is 4: document i goes to dp "
                                  "rank i % dp, so dp rank 3 would have none to read; add documents to --data, or train on "
                                  "at most 3 data-parallel replicas (fewer processes, or more pp/tp/sp)")
    check(TrainArgs(**{**vars(args), "pp": 2}), 4)  # dp 2
