"""Stateless collectives: flat and two-hop all-gathers, reduce-scatters, all-reduces, their int8 forms, and
the bytes they move. Nothing here knows about units or modules."""
