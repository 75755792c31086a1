#!/usr/bin/python3
"""A TCP relay that adds latency: each chunk read from one side is written to
the other side --delay_ms later (both directions), so a connection through it
has its round trip lengthened by twice that. Stands in for netem's delay where
the kernel has no netem qdisc. Order and bytes are kept; nothing is dropped.

  delay_relay.py --delay_ms 0.5 --map 127.0.0.1:6001=10.214.0.11:50071 [--map ...]
                 [--ready_file F]

Runs until killed. Writes the ready file once every listener is bound.
"""
import argparse
import asyncio
import socket

CHUNK = 1 << 20


async def pump(reader, writer, delay):
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()

    async def read():
        while True:
            data = await reader.read(CHUNK)
            await queue.put((loop.time() + delay, data))
            if not data:
                return

    async def write():
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(listen, target, delay):
    host, port = target.rsplit(":", 1)

    async def on_client(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        for w in (client_writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(client_reader, up_writer, delay),
                             pump(up_reader, client_writer, delay))

    lhost, lport = listen.rsplit(":", 1)
    return await asyncio.start_server(on_client, lhost, int(lport))


async def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay_ms", type=float, required=True, help="one-way delay added, ms")
    p.add_argument("--map", action="append", required=True, help="LISTEN_HOST:PORT=HOST:PORT")
    p.add_argument("--ready_file")
    a = p.parse_args()
    servers = []
    for m in a.map:
        listen, target = m.split("=", 1)
        servers.append(await serve(listen, target, a.delay_ms / 1000.0))
    if a.ready_file:
        with open(a.ready_file, "w") as f:
            f.write("ready\n")
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main())
