'use strict';
/**
 * `mosaic-peer`: a Mosaic service built as Mosaic's documentation and media template
 * build one, with Mosaic's own libraries: `@axinom/mosaic-message-bus` (rascal on
 * RabbitMQ) and `@axinom/mosaic-transactional-inbox-outbox` (pg-transactional-outbox on
 * PostgreSQL). txbox's interoperability test (tests/interop/test_mosaic_peer.py) runs it
 * beside a txbox service on one vhost.
 *
 * - accepts `CreateGadget` (command, its own contract): stores a gadget and publishes
 *   `GadgetCreated` through its outbox, in the inbox handler's transaction;
 * - sends `CreateWidget` to the txbox service `widget-service` at start (PEER_SEND_WIDGET)
 *   through its outbox, and records every `WidgetCreated` event it receives;
 * - tenant-scoped, as Mosaic's multi-tenant messages: accepts `TagGadget` and publishes
 *   `GadgetTagged` under the command's tenant and environment, read from the command's
 *   routing key (`<service>.<tenant>.<environment>.gadget.tag`, where Mosaic's inbox
 *   handler reads them); sends `TagWidget` at start (PEER_TAG_WIDGET, for PEER_TENANT_ID
 *   and PEER_ENVIRONMENT_ID) and records every `WidgetTagged`. The keys are filled by
 *   Mosaic's `getEnvironmentRoutingKey` and passed as the publication's `routingKey`, as a
 *   Mosaic service does; each such message is stored in `tenant_messages` with its key
 *   and printed as a line `mosaic-peer handled <type> on <routing key>`.
 *
 * Its messaging settings come from the contracts (messaging-settings.js, Mosaic's code
 * generator rules). PEER_FAIL_FIRST names a message type whose first delivery the inbox
 * writer refuses, so that delivery goes round Mosaic's delay/retry path.
 *
 * Event signing, as a Mosaic service configures it: PEER_SIGNING_PRIVATE_KEY (base64
 * PKCS#8, Mosaic's RMQ_EVENT_SIGNING_PRIVATE_KEY) and PEER_SIGNING_KEY_VERSION make the
 * message bus sign every event the peer publishes; PEER_KEY_SERVICE_URL turns on
 * Mosaic's validateSignedEventMiddleware for the events it receives, which looks
 * producers' public keys up in the key service at that URL (PEER_TRUSTED_KEYS: a JSON
 * list of Mosaic's extraTrustedPublicKeys entries, {serviceId, version, key}).
 *
 * Environment: PEER_CONTRACTS (folder), PEER_DATABASE_URL (its own database),
 * PEER_AMQP_URL, PEER_SEND_WIDGET, PEER_FAIL_FIRST, PEER_TAG_WIDGET, PEER_TENANT_ID,
 * PEER_ENVIRONMENT_ID, LOG_LEVEL, and the signing ones above.
 */
const { Pool } = require('pg');
const { Logger, ShutdownActionsMiddleware } = require('@axinom/mosaic-service-common');
const { setupMessagingBroker, validateSignedEventMiddleware } = require('@axinom/mosaic-message-bus');
const {
  RabbitMqInboxWriter,
  RascalTransactionalConfigBuilder,
  TransactionalInboxMessageHandler,
  TransactionalLogMapper,
  setupInboxStorage,
  setupOutboxStorage,
  setupPollingOutboxListener,
} = require('@axinom/mosaic-transactional-inbox-outbox');
const { DatabaseSetup, initializePollingMessageListener } = require('pg-transactional-outbox');
const { loadContracts } = require('./messaging-settings');

const SERVICE_ID = 'mosaic-peer';
const SCHEMA = 'app_private';
const env = (name, fallback) => {
  const value = process.env[name] ?? fallback;
  if (value === undefined) throw new Error(`${name} is not set`);
  return value;
};

const logLevel = env('LOG_LEVEL', 'INFO');
const logger = new Logger({ context: SERVICE_ID, config: { logLevel, serviceId: SERVICE_ID, isDev: false } });
const dbConfig = { connectionString: env('PEER_DATABASE_URL') };

/** The outbox and inbox tables and polling functions, created by the library's own SQL. */
const setupDatabase = async (pool) => {
  const database = (await pool.query('SELECT current_database() AS name')).rows[0].name;
  const exists = (await pool.query(`SELECT to_regclass('${SCHEMA}.inbox') AS t`)).rows[0].t;
  if (!exists) {
    for (const kind of ['outbox', 'inbox']) {
      const cfg = {
        outboxOrInbox: kind,
        database,
        schema: SCHEMA,
        table: kind,
        listenerRole: 'postgres',
        nextMessagesName: `next_${kind}_messages`,
      };
      await pool.query(DatabaseSetup.dropAndCreateTable(cfg));
      await pool.query(DatabaseSetup.createPollingFunction(cfg));
      await pool.query(DatabaseSetup.setupPollingIndexes(cfg));
    }
  }
  // Business tables: one row per handled message, so a message applied twice shows twice.
  await pool.query(`
    CREATE TABLE IF NOT EXISTS gadgets (n serial PRIMARY KEY, message_id uuid NOT NULL, gadget_id text NOT NULL, name text NOT NULL);
    CREATE TABLE IF NOT EXISTS widget_events (n serial PRIMARY KEY, message_id uuid NOT NULL, widget_id text NOT NULL, name text NOT NULL);
    CREATE TABLE IF NOT EXISTS widget_requests (n serial PRIMARY KEY, widget_id text NOT NULL, name text NOT NULL);
    CREATE TABLE IF NOT EXISTS tenant_messages (n serial PRIMARY KEY, message_id uuid NOT NULL, message_type text NOT NULL,
      routing_key text NOT NULL, tenant_id text, environment_id text, name text NOT NULL);
  `);
};

const listenerConfig = (kind) => ({
  outboxOrInbox: kind,
  dbListenerConfig: dbConfig,
  settings: {
    dbSchema: SCHEMA,
    dbTable: kind,
    enableMaxAttemptsProtection: kind === 'inbox',
    enablePoisonousMessageProtection: kind === 'inbox',
    nextMessagesFunctionSchema: SCHEMA,
    nextMessagesFunctionName: `next_${kind}_messages`,
    nextMessagesPollingIntervalInMs: 100,
    messageCleanupIntervalInMs: 0,
  },
});

const main = async () => {
  const contracts = loadContracts(env('PEER_CONTRACTS'));
  const own = contracts[SERVICE_ID];
  const widgets = contracts['widget-service'];
  const pool = new Pool(dbConfig);
  await setupDatabase(pool);

  const shutdownActions = new ShutdownActionsMiddleware(logger);
  shutdownActions.push(() => pool.end());
  const storeOutboxMessage = setupOutboxStorage(listenerConfig('outbox'), logger, { logLevel });
  const storeInboxMessage = setupInboxStorage(listenerConfig('inbox'), logger, { logLevel });

  const failFirst = process.env.PEER_FAIL_FIRST;
  const refused = new Set();
  const inboxWriter = new RabbitMqInboxWriter(storeInboxMessage, pool, logger, {
    customMessagePreProcessor: (message) => {
      if (message.messagingSettings.messageType === failFirst && !refused.has(message.messageId)) {
        refused.add(message.messageId);
        throw new Error(`injected: the first delivery of ${failFirst} goes round the delay/retry path`);
      }
    },
  });

  const amqp = new URL(env('PEER_AMQP_URL'));
  const config = {
    serviceId: SERVICE_ID,
    isDev: false,
    rmqProtocol: 'amqp',
    rmqHost: amqp.hostname,
    rmqPort: Number(amqp.port || 5672),
    rmqUser: decodeURIComponent(amqp.username),
    rmqPassword: decodeURIComponent(amqp.password),
    rmqVHost: decodeURIComponent(amqp.pathname.slice(1)) || '/',
    rmqVHostAssert: false,
  };
  if (process.env.PEER_SIGNING_PRIVATE_KEY) {
    config.rmqEventSigningPrivateKey = process.env.PEER_SIGNING_PRIVATE_KEY;
    config.rmqEventSigningKeyVersion = Number(env('PEER_SIGNING_KEY_VERSION'));
  }
  const builders = [
    new RascalTransactionalConfigBuilder(own.CreateGadget, config).subscribeForCommand(() => inboxWriter),
    new RascalTransactionalConfigBuilder(own.GadgetCreated, config).publishEvent(),
    new RascalTransactionalConfigBuilder(widgets.CreateWidget, config).sendCommand(),
    new RascalTransactionalConfigBuilder(widgets.WidgetCreated, config).subscribeForEvent(() => inboxWriter),
    new RascalTransactionalConfigBuilder(own.TagGadget, config).subscribeForCommand(() => inboxWriter),
    new RascalTransactionalConfigBuilder(own.GadgetTagged, config).publishEvent(),
    new RascalTransactionalConfigBuilder(widgets.TagWidget, config).sendCommand(),
    new RascalTransactionalConfigBuilder(widgets.WidgetTagged, config).subscribeForEvent(() => inboxWriter),
  ];
  const onMessageMiddleware = [];
  if (process.env.PEER_KEY_SERVICE_URL) {
    onMessageMiddleware.push(
      validateSignedEventMiddleware({
        builders,
        keyServiceBaseUrl: process.env.PEER_KEY_SERVICE_URL,
        getTokenCallback: async () => ({ accessToken: 'interop-token', expiresInSeconds: 3600 }),
        extraTrustedPublicKeys: JSON.parse(process.env.PEER_TRUSTED_KEYS ?? '[]'),
      }),
    );
  }
  const broker = await setupMessagingBroker({ config, builders, logger, shutdownActions, onMessageMiddleware });

  class CreateGadgetHandler extends TransactionalInboxMessageHandler {
    constructor() {
      super(own.CreateGadget, logger, {});
    }
    async handleMessage(message, client) {
      const gadgetId = message.aggregateId;
      await client.query('INSERT INTO gadgets (message_id, gadget_id, name) VALUES ($1, $2, $3)', [
        message.id,
        gadgetId,
        message.payload.name,
      ]);
      await storeOutboxMessage(gadgetId, own.GadgetCreated, { gadget_id: gadgetId, name: message.payload.name }, client, {
        envelopeOverrides: { message_context: message.metadata.messageContext },
      });
    }
  }
  class WidgetCreatedHandler extends TransactionalInboxMessageHandler {
    constructor() {
      super(widgets.WidgetCreated, logger, {});
    }
    async handleMessage(message, client) {
      await client.query('INSERT INTO widget_events (message_id, widget_id, name) VALUES ($1, $2, $3)', [
        message.id,
        message.payload.widget_id,
        message.payload.name,
      ]);
    }
  }
  /** Tenant and environment of a multi-tenant message, read from its routing key as Mosaic's inbox handler does. */
  const tenancyOf = (message) => {
    const routingKey = message.metadata?.fields?.routingKey ?? '';
    const [, tenantId, environmentId] = routingKey.split('.');
    return { routingKey, tenantId, environmentId };
  };
  const recordTenantMessage = async (client, message, name) => {
    const { routingKey, tenantId, environmentId } = tenancyOf(message);
    await client.query(
      'INSERT INTO tenant_messages (message_id, message_type, routing_key, tenant_id, environment_id, name) VALUES ($1, $2, $3, $4, $5, $6)',
      [message.id, message.messageType, routingKey, tenantId, environmentId, name],
    );
    console.log(`${SERVICE_ID} handled ${message.messageType} on ${routingKey}`);
    return { tenantId, environmentId };
  };
  class TagGadgetHandler extends TransactionalInboxMessageHandler {
    constructor() {
      super(own.TagGadget, logger, {});
    }
    async handleMessage(message, client) {
      const environment = await recordTenantMessage(client, message, message.payload.name);
      const gadgetId = message.aggregateId;
      await storeOutboxMessage(gadgetId, own.GadgetTagged, { gadget_id: gadgetId, name: message.payload.name }, client, {
        envelopeOverrides: { message_context: message.metadata.messageContext },
        options: { routingKey: own.GadgetTagged.getEnvironmentRoutingKey(environment) },
      });
    }
  }
  class WidgetTaggedHandler extends TransactionalInboxMessageHandler {
    constructor() {
      super(widgets.WidgetTagged, logger, {});
    }
    async handleMessage(message, client) {
      await recordTenantMessage(client, message, message.payload.name);
    }
  }
  const transactionalLogger = new TransactionalLogMapper(logger, logLevel);
  const [stopInbox] = initializePollingMessageListener(
    listenerConfig('inbox'),
    [new CreateGadgetHandler(), new WidgetCreatedHandler(), new TagGadgetHandler(), new WidgetTaggedHandler()],
    transactionalLogger,
  );
  const stopOutbox = setupPollingOutboxListener(listenerConfig('outbox'), broker, logger, { logLevel });
  shutdownActions.push(stopInbox);
  shutdownActions.push(stopOutbox);

  const widgetName = process.env.PEER_SEND_WIDGET;
  if (widgetName) {
    const client = await pool.connect();
    try {
      await client.query('BEGIN');
      const widgetId = `widget-${widgetName}`;
      await client.query('INSERT INTO widget_requests (widget_id, name) VALUES ($1, $2)', [widgetId, widgetName]);
      await storeOutboxMessage(widgetId, widgets.CreateWidget, { name: widgetName }, client, {
        envelopeOverrides: { message_context: { requested_by: SERVICE_ID } },
      });
      await client.query('COMMIT');
    } catch (error) {
      await client.query('ROLLBACK');
      throw error;
    } finally {
      client.release();
    }
  }
  const tagName = process.env.PEER_TAG_WIDGET;
  if (tagName) {
    const environment = { tenantId: env('PEER_TENANT_ID'), environmentId: env('PEER_ENVIRONMENT_ID') };
    const client = await pool.connect();
    try {
      await client.query('BEGIN');
      await storeOutboxMessage(`widget-${tagName}`, widgets.TagWidget, { name: tagName }, client, {
        envelopeOverrides: { message_context: { requested_by: SERVICE_ID } },
        options: { routingKey: widgets.TagWidget.getEnvironmentRoutingKey(environment) },
      });
      await client.query('COMMIT');
    } catch (error) {
      await client.query('ROLLBACK');
      throw error;
    } finally {
      client.release();
    }
  }
  console.log(`${SERVICE_ID} ready`);
};

process.on('unhandledRejection', (error) => {
  console.error(`${SERVICE_ID} failed:`, error);
  process.exit(1);
});
main().catch((error) => {
  console.error(`${SERVICE_ID} failed to start:`, error);
  process.exit(1);
});
