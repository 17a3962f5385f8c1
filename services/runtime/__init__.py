"""What every silod gRPC process shares: settings, server bootstrap, interceptors, clients."""
