"""Collectives: process groups, our ring and hierarchical all-reduce, compression, gradient buckets."""
