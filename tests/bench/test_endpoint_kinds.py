"""The endpoint-kinds probe: every kind measured each round, its table naming each kind's ratio to the listener."""

from kpool_pd.bench.endpoint_kinds import table
from kpool_pd.bench.ucxx_baseline import UcxxEndpoint


def test_table_gives_each_kind_its_median_rounds_and_ratio_to_the_listener():
    ms = {(41, UcxxEndpoint.LISTENER): [0.2, 0.4, 0.3], (41, UcxxEndpoint.WORKER_ADDRESS): [0.6, 0.9, 0.3],
          (41, UcxxEndpoint.WORKER_ADDRESS_PEER_ERRORS): [0.15, 0.15, 0.15]}
    line = table(ms).splitlines()[1]
    assert "0.300 [0.200 0.400 0.300] 1.00x" in line
    assert "0.600 [0.600 0.900 0.300] 2.00x" in line
    assert "0.150 [0.150 0.150 0.150] 0.50x" in line
