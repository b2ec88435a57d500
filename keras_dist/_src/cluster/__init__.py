"""Cluster membership: launcher environments, process launching, watchdogs."""

from keras_dist._src.cluster.environments import (
    ClusterConfigError,
    ClusterEnvironment,
    detect_environment,
)

__all__ = ["ClusterConfigError", "ClusterEnvironment", "detect_environment"]
