// Types first: the relay's producer and the Kafka client configuration it is
// built from cannot be named outside the runtime crate.
use outbox::runtime::kafka::client_config;
use outbox::runtime::relay::publish::Publisher;

fn main() {}
