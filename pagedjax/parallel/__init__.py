"""Device meshes, data-parallel routing, several processes."""
