import random

import pytest

from fedcomp.sim.links import DEVICES, LINKS, MBPS, DeviceProfile, LinkProfile, task_timing


def test_presets_match_published_figures():
    assert LINKS["slow4g"].up_Bps == pytest.approx(0.75 * MBPS)
    assert LINKS["slow4g"].down_Bps == pytest.approx(1.6 * MBPS)
    assert LINKS["slow4g"].rtt_s == pytest.approx(0.150)
    assert LINKS["3g"].loss == pytest.approx(0.005)
    assert LINKS["gprs"].up_Bps == pytest.approx(20e3 / 8)


def test_task_time_is_bytes_over_bandwidth_plus_rtt_plus_compute():
    link = LinkProfile("x", up_Bps=1000.0, down_Bps=4000.0, rtt_s=0.5)
    dev = DeviceProfile("d", s_per_sample=0.01, startup_s=1.0)
    t = task_timing(10.0, link, dev, down_bytes=8000, up_bytes=3000, samples=100, rng=random.Random(0))
    # 10 + 0.5 rtt + 8000/4000 down + 3000/1000 up + 1 + 100*0.01 compute
    assert t.finish_s == pytest.approx(10 + 0.5 + 2 + 3 + 1 + 1)
    assert t.delivered


def test_same_seed_same_fates_and_loss_rate():
    link = LINKS["gprs"].with_options(loss=0.2, disconnect=0.1)
    dev = DEVICES["phone"]

    def fates(seed):
        rng = random.Random(seed)
        return [task_timing(0, link, dev, down_bytes=1, up_bytes=1, samples=1, rng=rng) for _ in range(4000)]

    a, b = fates(7), fates(7)
    assert a == b
    lost = sum(t.lost for t in a) / len(a)
    assert lost == pytest.approx(1 - 0.8**2, abs=0.03)
    assert sum(t.disconnected for t in a) / len(a) == pytest.approx(0.1, abs=0.02)
    assert a != fates(8)


@pytest.mark.parametrize("kwargs", [dict(up_Bps=0), dict(rtt_s=-1), dict(loss=1.0), dict(disconnect=-0.1)])
def test_bad_profiles_are_rejected(kwargs):
    base = dict(name="x", up_Bps=1.0, down_Bps=1.0, rtt_s=0.0)
    with pytest.raises(ValueError):
        LinkProfile(**{**base, **kwargs})


def test_negative_bytes_rejected():
    with pytest.raises(ValueError):
        task_timing(0, LINKS["lte"], DEVICES["laptop"], down_bytes=-1, up_bytes=0, samples=0, rng=random.Random())
