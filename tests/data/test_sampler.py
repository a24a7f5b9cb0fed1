from clew.data.sampler import ResumableSampler


def test_sampler_is_seeded_and_resumes_exactly():
    rows = list(range(10))
    full = list(ResumableSampler(rows, 3, seed=5, epochs=2))
    assert len(full) == 6 and all(len(b) == 3 for b in full)
    assert full[:3] != full[3:]  # each epoch has its own order
    s = ResumableSampler(rows, 3, seed=5, epochs=2)
    it = iter(s)
    taken = [next(it) for _ in range(2)]
    resumed = ResumableSampler(rows, 3, seed=5, epochs=2)
    resumed.load_state_dict(s.state_dict())
    assert taken + list(resumed) == full


def test_checkpoint_on_an_epoch_boundary_resumes_into_the_next_epoch():
    rows = list(range(9))
    s = ResumableSampler(rows, 3, seed=1, epochs=3)
    it = iter(s)
    first_epoch = [next(it) for _ in range(3)]
    assert s.state_dict() == {"epoch": 1, "position": 0}
    r = ResumableSampler(rows, 3, seed=1, epochs=3)
    r.load_state_dict({"epoch": 0, "position": 3})  # as written by an older checkpoint
    rest = list(r)
    assert len(rest) == 6
    assert first_epoch + rest == list(ResumableSampler(rows, 3, seed=1, epochs=3))


def test_state_dict_round_trips_through_a_checkpoint():
    rows = list(range(10))
    s = ResumableSampler(rows, 2, seed=3, epochs=2)
    it = iter(s)
    taken = [next(it) for _ in range(7)]  # into the second epoch
    assert s.state_dict() == {"epoch": 1, "position": 2}
    resumed = ResumableSampler(rows, 2, seed=3, epochs=2)
    resumed.load_state_dict(s.state_dict())
    assert taken + list(resumed) == list(ResumableSampler(rows, 2, seed=3, epochs=2))
