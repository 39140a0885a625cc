"""Policies: what one layer saves for its backward pass, and how a policy is
applied to a layer function."""
