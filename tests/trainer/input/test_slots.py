"""input/slots.py on its own: the slot layout at every world size and accumulation, the resume rule over
every saved layout, and the streams' order, state and closing (stand-in streams, no data read).

tests/trainer/input/test_resume_world_size.py runs the same slots over real shards and through the trainer.
"""

from __future__ import annotations

import itertools

import pytest

from mlperf_bert.data.dataset import DataError
from mlperf_bert.input.slots import SlotLayout, SlotStream


class Stream:
    """A slot's stream: hands out its slot number, records loads and closes in a shared log."""

    def __init__(self, slot: int, log: list[str]) -> None:
        self.slot, self.log, self.position = slot, log, 0

    def next_batch(self) -> list:
        self.position += 1
        return [self.slot]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        self.log.append(f"load {self.slot}")

    def close(self) -> None:
        self.log.append(f"close {self.slot}")


class Readers:
    """The shared readers: closing is logged."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def close(self) -> None:
        self.log.append("close readers")


WORLDS, ACCUMULATIONS = range(1, 17), range(1, 9)


def test_the_ranks_slots_are_contiguous_and_cover_every_slot_once_at_every_layout():
    for world, accumulation in itertools.product(WORLDS, ACCUMULATIONS):
        layout = SlotLayout(world, accumulation, 2)
        owned = [list(layout.slots_of(rank)) for rank in range(world)]
        assert [s for slots in owned for s in slots] == list(range(world * accumulation)) == list(
            range(layout.slots)), (world, accumulation)
        assert all(slots == list(range(slots[0], slots[0] + accumulation)) for slots in owned)


def _expected_mismatch(saved: SlotLayout, here: SlotLayout) -> str | None:
    """The resume rule, written out: the same slots and micro-batch continue; else the flags to set."""
    if saved.slots == here.slots and saved.micro_batch == here.micro_batch:
        return None
    steps = saved.accumulation
    problem = (f"data position: saved with {saved.slots} slots of {saved.micro_batch} items per step "
               f"({saved.world_size} ranks x {steps} accumulation step{'s' if steps != 1 else ''}); this run has "
               f"{here.world_size} x {here.accumulation} of {here.micro_batch}")
    if saved.slots % here.world_size:
        return f"{problem}: resume at a number of ranks that divides {saved.slots}"
    accumulation = saved.slots // here.world_size
    return (f"{problem}: set --gradient_accumulation_steps {accumulation} and --train_batch_size "
            f"{accumulation * saved.micro_batch}")


def test_a_saved_position_continues_exactly_at_the_layouts_of_the_same_slots_and_micro_batch():
    """Every saved layout against every layout up to 8 ranks x 4 micro-batches of 1 to 3 items."""
    layouts = [SlotLayout(w, a, b) for w in range(1, 9) for a in range(1, 5) for b in (1, 2, 3)]
    for saved, here in itertools.product(layouts, layouts):
        assert here.mismatch(saved.record()) == _expected_mismatch(saved, here), (saved, here)


def test_the_record_names_ranks_and_accumulation_apart():
    assert SlotLayout(4, 2, 3).record() == {"slots": 8, "micro_batch": 3, "ranks": 4, "accumulation": 2}


def _stream(world: int, accumulation: int, rank: int, log: list[str]) -> SlotStream:
    return SlotStream.open(lambda slot: Stream(slot, log), SlotLayout(world, accumulation, 1), rank, Readers(log))


def test_a_rank_reads_its_slots_in_turn_and_every_slot_takes_a_loaded_position():
    log: list[str] = []
    stream = _stream(3, 4, 1, log)
    assert [stream.next_batch()[0] for _ in range(9)] == [4, 5, 6, 7, 4, 5, 6, 7, 4]
    with pytest.raises(DataError, match="saved after micro-batch 1 of a step"):
        stream.load_state_dict(stream.state_dict())
    for _ in range(3):
        stream.next_batch()
    state = stream.state_dict()
    assert state == {"slots": 12, "micro_batch": 1, "ranks": 3, "accumulation": 4, "next_micro_batch": 0,
                     "stream": {"position": 3}}
    fresh = _stream(6, 2, 0, log)
    log.clear()
    fresh.load_state_dict(state)
    assert log == ["load 0", "load 1"] and [s.position for s in fresh.streams] == [3, 3]


@pytest.mark.parametrize("inside", range(1, 4))
def test_a_position_saved_inside_a_step_is_refused_wherever_inside(inside):
    state = {**SlotLayout(1, 4, 1).record(), "next_micro_batch": inside, "stream": {"position": 0}}
    with pytest.raises(DataError, match=f"saved after micro-batch {inside} of a step"):
        _stream(1, 4, 0, []).load_state_dict(state)


def test_closing_closes_the_streams_before_their_shared_readers():
    log: list[str] = []
    _stream(2, 3, 1, log).close()
    assert log == ["close 3", "close 4", "close 5", "close readers"]


def test_a_slot_that_fails_to_open_closes_the_ones_opened_before_it():
    log: list[str] = []

    def make(slot: int) -> Stream:
        if slot == 6:
            raise DataError("shard gone")
        return Stream(slot, log)

    with pytest.raises(DataError, match="shard gone"):
        SlotStream.open(make, SlotLayout(2, 4, 1), 1, Readers(log))
    assert log == ["close 4", "close 5", "close readers"]
