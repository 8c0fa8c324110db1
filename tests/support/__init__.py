"""Helpers the test modules share: tiny model builders, engine geometries and builds,
reference outputs, drivers and servers. Test modules import from here, never from each
other; caches whose values hold device state register with `device_caches`."""
