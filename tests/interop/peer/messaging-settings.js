'use strict';
/**
 * Messaging settings of a service, derived from its AsyncAPI contract with the rules of
 * Mosaic's code generator (the classes it writes to `src/generated/config/...`), not
 * with txbox's code: for each channel operation one object with
 *
 * - `messageType`: the payload schema's `title` in PascalCase without its trailing
 *   Command/Event word (`create_gadget_command` → `CreateGadget`);
 * - `queue`: the channel's `bindings.amqp.queue.name` (Mosaic: always `inbox`);
 * - `routingKey`: the channel name (`entity.action`); the message bus puts the service id
 *   in front of it;
 * - `action`: `publish` → `command`, `subscribe` → `event`;
 * - `aggregateType`: from the tag `aggregate-type:<x>`;
 * - `serviceId`: the contract's `x-service-id` (top level, else `info`), else
 *   `info.title` in lower-kebab-case.
 *
 * A multi-tenant channel (`*.*.entity.action`) gives an instance of Mosaic's
 * `MultiTenantMessagingSettings` instead, so its `getEnvironmentRoutingKey` (Mosaic's
 * own code) fills the two placeholders with a tenant and an environment id.
 */
const fs = require('node:fs');
const path = require('node:path');
const yaml = require('js-yaml');
const { MultiTenantMessagingSettings } = require('@axinom/mosaic-message-bus-abstractions');

class MultiTenantSettings extends MultiTenantMessagingSettings {}

const pascalCase = (text) =>
  text
    .split(/[^A-Za-z0-9]+/)
    .filter(Boolean)
    .map((word) => word[0].toUpperCase() + word.slice(1))
    .join('');

const messageTypeOf = (schemaTitle) => pascalCase(schemaTitle).replace(/(?<=.)(Command|Event)$/, '');

const kebabCase = (text) =>
  text
    .replace(/([a-z0-9])([A-Z])/g, '$1 $2')
    .split(/[^A-Za-z0-9]+/)
    .filter(Boolean)
    .map((word) => word.toLowerCase())
    .join('-');

const readDocument = (file) => {
  const text = fs.readFileSync(file, 'utf-8');
  return file.endsWith('.json') ? JSON.parse(text) : yaml.load(text);
};

/** Every AsyncAPI document under `folder`, by service id. */
const loadContracts = (folder) => {
  const contracts = {};
  const walk = (dir) => {
    for (const entry of fs.readdirSync(dir, { withFileTypes: true })) {
      const file = path.join(dir, entry.name);
      if (entry.isDirectory()) {
        walk(file);
      } else if (/\.(json|ya?ml)$/.test(entry.name)) {
        const doc = readDocument(file);
        if (doc && typeof doc === 'object' && doc.asyncapi) {
          const serviceId = doc['x-service-id'] ?? doc.info?.['x-service-id'] ?? kebabCase(doc.info?.title ?? '');
          contracts[serviceId] = settingsOf(doc, path.dirname(file), serviceId);
        }
      }
    }
  };
  walk(folder);
  return contracts;
};

const settingsOf = (doc, dir, serviceId) => {
  const settings = { serviceId };
  for (const [channel, item] of Object.entries(doc.channels ?? {})) {
    for (const [operation, action] of [
      ['publish', 'command'],
      ['subscribe', 'event'],
    ]) {
      if (!item[operation]) continue;
      const ref = item[operation].message.$ref.replace('#/components/messages/', '');
      const message = doc.components.messages[ref];
      const schema = readDocument(path.join(dir, message.payload.$ref));
      const tag = (message.tags ?? []).map((t) => t.name).find((name) => name.startsWith('aggregate-type:'));
      const messageType = messageTypeOf(schema.title);
      const queue = item.bindings?.amqp?.queue?.name ?? 'inbox';
      const aggregateType = tag.slice('aggregate-type:'.length);
      settings[messageType] = channel.startsWith('*.*.')
        ? new MultiTenantSettings(serviceId, messageType, queue, channel, action, aggregateType)
        : { serviceId, messageType, queue, routingKey: channel, action, aggregateType };
    }
  }
  return settings;
};

module.exports = { loadContracts, messageTypeOf };
