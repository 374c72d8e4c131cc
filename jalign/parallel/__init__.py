"""Mesh, logical-axis rules and shardings for parameters, optimizer state and batches.

Convention: Auto axis types (see jalign.models.sharding); parameters carry explicit NamedShardings, batches are
split over the data-parallel axes ('data', 'fsdp', 'expert') on their leading axis, optimizer state follows its parameter, scalars are replicated.
"""
from jalign.parallel.shardings import (
                                      batch_sharding,
                                      fetching,
                                      in_memory,
                                      mesh_from_config,
                                      optimizer_shardings,
                                      replicated,
                                      split_meshes,
)

__all__ = ["batch_sharding", "fetching", "in_memory", "mesh_from_config", "optimizer_shardings", "replicated",
           "split_meshes"]
