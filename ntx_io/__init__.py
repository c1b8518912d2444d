"""Storage to pinned buffers: userspace NVMe driver, kernel-path readers, model staging (`ntx-io`)."""
