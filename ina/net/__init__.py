"""Emulated links: network namespaces, veth links and Linux tc shaping, through pyroute2.

See docs/links.md. The API used by experiments and launchers::

    from ina.net import Topology
    with Topology(workers=4, rate="100mbit") as topo:
        topo.popen(topo.switch, [...]); topo.set_rate("all", "1gbit"); topo.counters()
"""
from .nsexec import PrivilegeError, missing_caps, require_privileges
from .shaping import RateError, TbfParams, format_rate, parse_rate, tbf_params
from .kernel import (HOST_IFNAME, LinkCounters, NetemProbe, NetemUnavailable, TopologyError, list_topologies,
                     netem_available, probe_netem, teardown)
from .topology import Host, Topology

__all__ = ["Topology", "Host", "LinkCounters", "TopologyError", "NetemUnavailable", "PrivilegeError",
           "RateError", "TbfParams", "parse_rate", "format_rate", "tbf_params", "list_topologies",
           "teardown", "netem_available", "probe_netem", "missing_caps", "require_privileges",
           "HOST_IFNAME", "NetemProbe"]
