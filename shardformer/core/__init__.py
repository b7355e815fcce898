"""The pieces every technique shares: configs, the process mesh, the sharding record, collectives, RNG."""
