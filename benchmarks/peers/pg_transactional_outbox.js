// pg-transactional-outbox under load, with amqplib as the RabbitMQ client.
//
// Runs in a scratch folder where run.py has npm-installed pg-transactional-outbox, pg
// and amqplib; it uses only their public APIs.
//   relay: the polling listener (logical replication needs wal_level=logical) hands
//          each outbox row to a publisher that publishes it persistent on a confirm
//          channel and resolves on the broker's ack; the library then marks the row
//          processed in the same transaction that locked it.
//   inbox: an amqplib consumer stores each delivery with the inbox message storage
//          (one INSERT ... ON CONFLICT DO NOTHING in its own transaction) and acks it
//          once committed, many deliveries at once (no mutex: concurrency 'parallel').
//
// Protocol with run.py: argv[2] is a JSON config; the program sets the tables up (and
// for the relay fills the outbox through the message storage), connects, prints READY,
// waits for a GO line on stdin, works, and exits on a STOP line or end of input.
'use strict';
const crypto = require('node:crypto');
const readline = require('node:readline');
const { Pool } = require('pg');
const amqp = require('amqplib');
const {
  DatabaseSetup,
  getDisabledLogger,
  initializeMessageStorage,
  initializePollingMessageListener,
  executeTransaction,
  IsolationLevel,
} = require('pg-transactional-outbox');

const cfg = JSON.parse(process.argv[2]);
const lines = readline.createInterface({ input: process.stdin });
const nextLine = () =>
  new Promise((resolve) => {
    lines.once('line', resolve);
    lines.once('close', () => resolve(''));
  });
// Logging off, as a service at full load would run it; PEER_LOG=1 turns the library's
// warnings on (to standard error) when a run needs looking into.
const logger = process.env.PEER_LOG
  ? require('pg-transactional-outbox').getDefaultLogger('bench')
  : getDisabledLogger();
const db = { connectionString: cfg.database_url };

async function setup(outboxOrInbox) {
  const conf = {
    outboxOrInbox,
    database: cfg.database,
    schema: 'public',
    table: outboxOrInbox,
    listenerRole: 'postgres',
    nextMessagesName: `next_${outboxOrInbox}_messages`,
  };
  const admin = new Pool(db);
  await admin.query(DatabaseSetup.dropAndCreateTable(conf));
  await admin.query(DatabaseSetup.createPollingFunction(conf));
  await admin.query(DatabaseSetup.setupPollingIndexes(conf));
  await admin.end();
}

const settings = (outboxOrInbox) => ({
  dbSchema: 'public',
  dbTable: outboxOrInbox,
  enableMaxAttemptsProtection: false,
  enablePoisonousMessageProtection: false,
  messageCleanupIntervalInMs: 0,
});

async function relay() {
  await setup('outbox');
  const config = {
    outboxOrInbox: 'outbox',
    dbListenerConfig: { ...db, max: 4 },
    dbHandlerConfig: { ...db, max: cfg.pool_size },
    settings: {
      ...settings('outbox'),
      nextMessagesFunctionName: 'next_outbox_messages',
      nextMessagesBatchSize: cfg.batch_size,
      nextMessagesPollingIntervalInMs: cfg.polling_interval_ms,
      nextMessagesLockInMs: cfg.lock_ms,
    },
  };
  // Fill the outbox the library's way: the message storage inside the caller's transaction.
  const store = initializeMessageStorage(config, logger);
  const pool = new Pool(db);
  for (let done = 0; done < cfg.messages; done += 1000) {
    await executeTransaction(
      await pool.connect(),
      async (client) => {
        for (let i = done; i < Math.min(done + 1000, cfg.messages); i++) {
          await store(
            {
              id: crypto.randomUUID(),
              aggregateType: 'order',
              aggregateId: `bench-${i}`,
              messageType: 'PlaceOrder',
              segment: `order:bench-${i}`,
              concurrency: 'parallel',
              payload: cfg.payload,
              metadata: {},
              createdAt: new Date().toISOString(),
            },
            client,
          );
        }
      },
      IsolationLevel.ReadCommitted,
    );
  }
  await pool.end();

  const connection = await amqp.connect(cfg.amqp_url);
  const channel = await connection.createConfirmChannel();
  const publisher = {
    handle: (message) =>
      new Promise((resolve, reject) => {
        channel.publish(
          cfg.exchange,
          cfg.routing_key,
          Buffer.from(JSON.stringify(message)),
          { persistent: true, contentType: 'application/json', messageId: message.id },
          (err) => (err ? reject(err) : resolve()),
        );
      }),
  };
  console.log('READY');
  if ((await nextLine()).trim() !== 'GO') return connection.close();
  const [shutdown] = initializePollingMessageListener(config, publisher, logger);
  await nextLine();
  await shutdown();
  await connection.close();
}

async function inbox() {
  await setup('inbox');
  const config = {
    outboxOrInbox: 'inbox',
    dbListenerConfig: db,
    settings: { ...settings('inbox'), nextMessagesFunctionName: 'next_inbox_messages' },
  };
  const store = initializeMessageStorage(config, logger);
  const pool = new Pool({ ...db, max: cfg.pool_size });
  const connection = await amqp.connect(cfg.amqp_url);
  const channel = await connection.createChannel();
  await channel.prefetch(cfg.prefetch);
  console.log('READY');
  if ((await nextLine()).trim() !== 'GO') return connection.close();
  await channel.consume(cfg.queue, async (delivery) => {
    const message = JSON.parse(delivery.content.toString());
    try {
      await executeTransaction(
        await pool.connect(),
        async (client) => store(message, client),
        IsolationLevel.ReadCommitted,
      );
      channel.ack(delivery);
    } catch (err) {
      console.error(`store failed: ${err}`);
      channel.nack(delivery);
    }
  });
  await nextLine();
  await channel.close();
  await connection.close();
  await pool.end();
}

(cfg.mode === 'relay' ? relay() : inbox()).then(
  () => process.exit(0),
  (err) => {
    console.error(err);
    process.exit(1);
  },
);
