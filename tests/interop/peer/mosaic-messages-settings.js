'use strict';
/**
 * Mosaic's generated messaging settings (the classes `@axinom/mosaic-messages` exports from
 * its `src/generated/config`), each with what Mosaic's own message bus
 * (`RascalConfigBuilder` of `@axinom/mosaic-message-bus`) makes of it on the broker:
 *
 * - `wireRoutingKey`: the routing key the message is published with (a command as sent
 *   to its service, an event as its service publishes it);
 * - `receiveQueue`: the queue a Mosaic service receives it in (a command: the service
 *   itself; an event: the subscriber named by the first argument).
 *
 * Prints one JSON array on stdout.
 */
const messages = require('@axinom/mosaic-messages');
const { RascalConfigBuilder } = require('@axinom/mosaic-message-bus');

const subscriber = process.argv[2] ?? 'txbox-subscriber';
const vhost = 'v';
const built = (settings, serviceId, build) =>
  build(new RascalConfigBuilder(settings, { serviceId, rmqVHost: vhost })).buildConfig({}).vhosts[vhost];

const out = [];
for (const [settingsClass, cls] of Object.entries(messages)) {
  if (typeof cls !== 'function' || !settingsClass.endsWith('MessagingSettings')) {
    continue;
  }
  for (const settings of Object.values(cls)) {
    if (!(settings instanceof cls)) {
      continue;
    }
    const { messageType, queue, routingKey, action, aggregateType, serviceId } = settings;
    const command = action === 'command';
    const sent = command
      ? built(settings, subscriber, (b) => b.sendCommand())
      : built(settings, serviceId, (b) => b.publishEvent());
    const received = command
      ? built(settings, serviceId, (b) => b.subscribeForCommand(() => null))
      : built(settings, subscriber, (b) => b.subscribeForEvent(() => null));
    out.push({
      settingsClass,
      messageType,
      queue,
      routingKey,
      action,
      aggregateType,
      serviceId,
      wireRoutingKey: sent.publications[messageType].routingKey,
      receiveQueue: Object.keys(received.queues)[0],
    });
  }
}
process.stdout.write(JSON.stringify(out));
